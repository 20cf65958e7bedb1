"""CF scaling policies and their registry: ``names()``, ``create(name, **options)``."""

from gravac.policies import accordion, exponential, fixed, geometric
from gravac.policies.accordion import AccordionPolicy
from gravac.policies.base import ScalingPolicy, create, get, names, register
from gravac.policies.exponential import ExponentialPolicy
from gravac.policies.fixed import FixedPolicy
from gravac.policies.geometric import GeometricPolicy

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
