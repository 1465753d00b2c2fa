"""`hearth bench hostile`'s search: the largest body of each family still accepted sits at its bound (no model needed)."""

from app.devtools.serving import hostile_bench as hb
from app.schema_subset import MAX_GRAMMAR_LEFT_DEPTH, MAX_GRAMMAR_NESTING, MAX_GRAMMAR_WIDTH


def test_the_search_finds_each_bound_from_below():
    assert hb._largest(hb.FAMILIES["GBNF nested groups"]) == MAX_GRAMMAR_NESTING
    assert hb._largest(hb.FAMILIES["GBNF left chain"]) == MAX_GRAMMAR_LEFT_DEPTH
    assert hb._largest(hb.FAMILIES["GBNF alternatives"]) == MAX_GRAMMAR_WIDTH
    assert hb._largest(hb.FAMILIES["anyOf within anyOf"]) == 25  # 25 × 40 = the 1000 alternatives allowed


def test_refused_bodies_are_refused_and_accepted_ones_build_a_grammar():
    for extra in hb.REFUSED.values():
        assert hb._build(extra)[1] is not None
    grammar, refusal = hb._build(hb.FAMILIES["GBNF nested groups"](10))
    assert refusal is None and grammar.gbnf.startswith("root ::=")
