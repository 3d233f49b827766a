"""Autobatching strategies: plan which nodes run together (none / depth / agenda)."""
from .plans import PlanCache
from .strategies import by_agenda, by_depth, schedule

__all__ = ["PlanCache", "by_agenda", "by_depth", "schedule"]
