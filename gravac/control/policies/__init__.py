"""CF scaling policies and their registry: ``names()``, ``create(name, **options)``."""

from gravac.control.policies import accordion, exponential, fixed, geometric
from gravac.control.policies.accordion import AccordionPolicy
from gravac.control.policies.base import ScalingPolicy, create, get, names, register
from gravac.control.policies.exponential import ExponentialPolicy
from gravac.control.policies.fixed import FixedPolicy
from gravac.control.policies.geometric import GeometricPolicy

__all__ = [
    "AccordionPolicy",
    "ExponentialPolicy",
    "FixedPolicy",
    "GeometricPolicy",
    "ScalingPolicy",
    "accordion",
    "create",
    "exponential",
    "fixed",
    "geometric",
    "get",
    "names",
    "register",
]
