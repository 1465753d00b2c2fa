"""The Models page shows the RAM tier's budget among the estimate's parts, and checks a load against the rest."""

from app.gateway.context import services
from app.residency.estimate import MIB
from app.store.settings import set_setting
from app.web.queries import model_cards


def _card(app):
    hearth = services(app)
    with hearth.sessions() as s:
        return next(c for c in model_cards(hearth.catalog, [], s) if c.usable)


def test_the_estimate_lists_the_ram_tier_in_its_total_and_follows_the_setting(app, admin):
    hearth = services(app)
    with hearth.sessions() as s:
        set_setting(s, "runner_cache_ram_mib", 300)
        s.commit()
    hearth.catalog.rescan()
    card = _card(app)
    assert card.estimate.ram_tier_bytes == 300 * MIB
    assert card.estimate.total_bytes == card.estimate.at_load_bytes + 300 * MIB
    html = admin.get("/models").get_data(as_text=True)
    table = html.split('aria-label="Memory estimate"', 1)[1].split("</table>", 1)[0]
    row = table.split('class="ram-tier"', 1)[1].split("</tr>", 1)[0]
    assert "RAM tier" in row and "300.0 MiB" in row
    # A load is measured before the tier holds anything: the error is against the estimate without it.
    card.measured_bytes = card.estimate.at_load_bytes
    assert card.estimate_error_pct == 0.0
    with hearth.sessions() as s:
        set_setting(s, "runner_cache_ram_mib", 0)
        s.commit()
    hearth.catalog.rescan()
    assert _card(app).estimate.ram_tier_bytes == 0
    html = admin.get("/models").get_data(as_text=True)
    row = html.split('class="ram-tier"', 1)[1].split("</tr>", 1)[0]
    assert ">off<" in row
