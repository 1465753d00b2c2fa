"""hearth bench templates' bookkeeping: outcomes, the parity share, the details and the golden files (no servers)."""

from __future__ import annotations

import json
from datetime import date

from app.devtools.parity.template_parity import (
    HISTORIES,
    Render,
    TemplateResult,
    date_dependent,
    details,
    first_difference,
    render_in_process,
    summary,
    write_goldens,
)


def _result(name: str, stock: dict, hearth: dict) -> TemplateResult:
    r = TemplateResult(name, "0" * 64)
    for h in HISTORIES:
        r.stock[h], r.hearth[h] = stock.get(h, Render("same")), hearth.get(h, Render("same"))
    return r


def test_outcomes_and_the_share_count_only_what_llama_server_renders():
    refused = Render(None, "400: no")
    r = _result("t.jinja", {"tools": refused, "reasoning": refused},
                {"plain": Render("other"), "multi_turn": refused, "tools": refused, "reasoning": Render("x")})
    assert [r.outcome(h) for h in HISTORIES] == ["different", "hearth_refused", "both_refused", "stock_refused",
                                                "identical"]
    s = summary([r])
    assert (s["identical"], s["stock_rendered"], s["parity_pct"]) == (1, 3, 33.33)


def test_details_give_the_first_differing_offset_and_both_sides():
    r = _result("t.jinja", {"plain": Render("abcdef")}, {"plain": Render("abcxef")})
    [row] = details([r])
    assert row["offset"] == 3 == first_difference("abcdef", "abcxef")
    assert (row["stock"], row["hearth"]) == ("abcdef", "abcxef")
    assert first_difference("abc", "abcd") == 3


def test_golden_files_keep_the_date_only_when_a_render_prints_it(tmp_path):
    day = date(2026, 12, 2)
    assert date_dependent(["Today Date: 02 Dec 2026\n"], day) and not date_dependent(["no date"], day)
    dated = _result("dated.jinja", {"plain": Render("Today is Dec 02 2026.")}, {})
    write_goldens([dated, _result("plain.jinja", {}, {})], tmp_path, day, "<bos>", "<eos>")
    doc = json.loads((tmp_path / "dated.json").read_text())
    assert doc["date"] == "2026-12-02" and doc["bos_token"] == "<bos>"
    assert doc["renders"]["plain"] == {"prompt": "Today is Dec 02 2026."}
    assert json.loads((tmp_path / "plain.json").read_text())["date"] is None


def test_in_process_rendering_uses_the_given_date_and_strips_the_bos_text():
    source = "{{ bos_token }}{{ strftime_now('%d %b %Y') }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    r = render_in_process(source, HISTORIES["plain"], "<bos>", "<eos>", date(2025, 1, 2))
    assert r.prompt == "02 Jan 2025:Hello! Who are you?"
    assert render_in_process("{% for %}", HISTORIES["plain"], "", "").error.startswith("chat template")
