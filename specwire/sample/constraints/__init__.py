"""Constraints on the target's sampling: GBNF grammars and JSON schemas.

A constraint is part of the target's sampling, not a filter on the output:
the verifier's reference token at each position is the target's constrained
sample, so a draft, whatever it proposed, never changes what comes out.
"""

from specwire.sample.constraints.grammar import Grammar, GrammarSpec
from specwire.sample.constraints.json_schema import JSON_OBJECT, schema_grammar

__all__ = ["JSON_OBJECT", "Grammar", "GrammarSpec", "schema_grammar"]
