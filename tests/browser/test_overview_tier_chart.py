"""The overview's stacked prompt-token chart and KV tier card in a real browser, fed by a real runner through serve."""

import httpx

# The stacked chart's parts at the latest point where any is above zero: {label: own value}, and the drawn top.
STACK_AT_LAST = """() => {
  const c = (window.Hearth && Hearth.charts || []).find(c => c.el.id === 'chart-prompt-parts');
  if (!c || !c.plot) return null;
  const raw = c.data, drawn = c.plot.data;
  let idx = -1;
  for (let j = raw[0].length - 1; j >= 0 && idx < 0; j -= 1)
    if (raw.slice(1).some(d => d[j] > 0)) idx = j;
  if (idx < 0) return null;
  const parts = {};
  c.names.forEach((name, i) => { parts[name] = c.partValue(i + 1, idx); });
  return {parts, top: drawn[1][idx], order: c.names, own: raw.slice(1).map(d => d[idx])};
}"""


def test_the_stacked_chart_piles_up_the_parts_and_the_tier_card_names_the_runner(page, served):
    page.goto("/")
    for section in ("throughput", "speculation"):  # the stacked chart and the tier card, in sections a person opens
        page.click(f"#section-{section} > summary")
    with httpx.Client(base_url=served.url, timeout=120, headers={"Authorization": f"Bearer {served.token}"}) as client:
        system = "You are the household's assistant. " + " ".join(f"Rule {i}: be kind and brief." for i in range(40))
        for question in ("What is two and two?", "What is three and three?"):
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
    # The second request's system prompt came from the KV cache: the chart shows reused and computed tokens.
    page.wait_for_function(f"() => {{ const s = ({STACK_AT_LAST})(); return s && s.parts['KV cache'] > 0; }}",
                           timeout=60_000)
    stack = page.evaluate(STACK_AT_LAST)
    # Drawn top of the stack first; each part's legend value is its own, and the top is their sum.
    assert stack["order"] == ["computed", "disk tier", "RAM tier", "KV cache"]
    assert stack["top"] == sum(stack["own"])
    assert sorted(stack["parts"].values()) == sorted(stack["own"])
    page.wait_for_function("() => document.querySelector('#overview-tiers').innerText.includes('gemma')",
                           timeout=30_000)
    card = page.locator("#overview-tiers").inner_text()
    assert "RAM" in card and "disk" in card and "of 2.0 GiB" in card
