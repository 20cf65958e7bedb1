"""The searches, each a :class:`gravac.control.protocol.Controller` composed of the measures and
tables it reads, none inheriting another:

* :mod:`~gravac.control.searches.static`: a static CF;
* :mod:`~gravac.control.searches.paper`: GraVAC's Algorithm 1;
* :mod:`~gravac.control.searches.trial`: each candidate sent for a window and judged by it;
* :mod:`~gravac.control.searches.shadow`: every candidate judged at once by error feedback
  replayed on a sample;
* :mod:`~gravac.control.searches.accordion`: Accordion's per-layer regimes;
* :mod:`~gravac.control.searches.sent` and :mod:`~gravac.control.searches.common`: what the
  searches by trial and shadow share.
"""
