"""Autobatching strategies: plan which nodes run together (none / depth / agenda), and the
cache of plans for recurring graph shapes."""
from .plans import PlanCache
from .strategies import by_agenda, by_depth, schedule

__all__ = ["PlanCache", "by_agenda", "by_depth", "schedule"]
