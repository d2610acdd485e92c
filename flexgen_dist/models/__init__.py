"""Model shapes, the math of each family, and where weights come from.

Every family module is imported here, so each has registered itself in ``families.py`` before
anything under flexgen_dist.models is used; a new family module is added to this import.
"""
from . import cohere, gemma, llama, neox, opt  # noqa: F401  (imported for their registration)
