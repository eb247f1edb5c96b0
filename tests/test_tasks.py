"""Task metrics and audit checks on hand-made good and bad outputs, and the SVG side-by-side image."""

import json

import pytest
from PIL import Image

from freetune.data import completion_text
from freetune.errors import FreetuneError
from freetune.tasks import home_assistant, load_task, svg

NS = 'xmlns="http://www.w3.org/2000/svg"'
GOOD_SVG = f'<svg {NS} width="100" height="100"><rect width="100" height="100" fill="#ff0000"/></svg>'


def read_rows(path, n=5):
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


# ----------------------------------------------------------------------------------------------------- SVG

def test_svg_metrics_good_output_with_text_around_it():
    assert svg.metrics(f"Here is your icon:\n{GOOD_SVG}\nEnjoy.", {}) == {
        "has_svg_block": True, "well_formed_xml": True, "renders": True, "only_valid_tags": True}


def test_svg_metrics_no_svg_block():
    assert svg.metrics("I cannot draw that.", {}) == {
        "has_svg_block": False, "well_formed_xml": False, "renders": False, "only_valid_tags": False}


@pytest.mark.parametrize("broken", [
    f'<svg {NS} width="10" height="10"><rect width="10" height="10"></svg>',  # unclosed rect
    f'<svg {NS} width="10" height="10"><rect width="10" height="10"/>',       # never closed (cut off)
    f'<svg {NS} width="10 height="10"><rect/></svg>',                         # broken attribute quoting
])
def test_svg_metrics_broken_xml(broken):
    result = svg.metrics(broken, {})
    assert result["has_svg_block"] is True
    assert result["well_formed_xml"] is False
    assert result["renders"] is False


@pytest.mark.parametrize("unrenderable", [
    f'<svg {NS} width="0" height="0"><rect width="10" height="10"/></svg>',  # zero size
    f'<svg {NS}><circle r="4"/></svg>',                                      # no size, no viewBox
    f'<svg {NS} width="10" height="10"><path d="M 1 1 A 1 1"/></svg>',  # arc cut off: cairosvg raises
])
def test_svg_metrics_well_formed_but_does_not_render(unrenderable):
    result = svg.metrics(unrenderable, {})
    assert result["well_formed_xml"] is True
    assert result["renders"] is False
    assert svg.render_svg(svg.svg_block(unrenderable))[1]  # a reason is given


def test_svg_metrics_invalid_tags():
    invented = f'<svg {NS} width="10" height="10"><circl r="3"/><lineargradient id="g"/></svg>'
    assert svg.invalid_tags(invented) == ["circl", "lineargradient"]  # SVG is case-sensitive
    result = svg.metrics(invented, {})
    assert result["well_formed_xml"] is True and result["only_valid_tags"] is False
    # Invented tags are still found when the XML is broken.
    assert svg.invalid_tags(f'<svg {NS}><circl r="3"><rect></svg>') == ["circl"]


def test_svg_valid_tags_include_svg2_and_foreign_namespaces():
    text = (f'<svg {NS} xmlns:inkscape="http://www.inkscape.org/namespaces/inkscape" width="10" height="10">'
            '<defs><linearGradient id="g"><stop offset="0"/></linearGradient>'
            '<filter id="f"><feDropShadow dx="1" dy="1"/></filter></defs>'
            '<inkscape:perspective/><g><path d="M0 0 L10 10"/></g></svg>')
    assert svg.invalid_tags(text) == []
    assert svg.metrics(text, {})["only_valid_tags"] is True


def test_render_svg_bounds_the_size_of_huge_declared_images():
    picture, reason = svg.render_svg(f'<svg {NS} width="30000" height="15000"><circle cx="5" cy="5" r="5"/></svg>',
                                     side=200)
    assert reason is None
    assert picture.size == (200, 100)


def test_svg_summarise_gives_rates():
    results = [svg.metrics(GOOD_SVG, {}), svg.metrics("no", {}), svg.metrics(f'<svg {NS}><x></svg>', {}),
               svg.metrics(f'<svg {NS} width="9" height="9"><bogus/></svg>', {})]
    assert svg.summarise(results) == {"outputs": 4, "has_svg_block": 0.75, "well_formed_xml": 0.5,
                                      "renders": 0.5, "only_valid_tags": 0.25}


def test_svg_audit_checks(svg_sample):
    good_rows = read_rows(svg_sample, 20)
    assert [name for row in good_rows for name, check in svg.AUDIT_CHECKS.items() if check(row)] == []
    no_svg = {"prompt": "Draw a cat.", "completion": "No valid response from model."}
    broken = {"prompt": "Draw a cat.", "completion": f'<svg {NS}><rect></svg>'}
    as_messages = {"messages": [{"role": "user", "content": "Draw a cat."},
                                {"role": "assistant", "content": f'<svg {NS}><rect></svg>'}]}
    assert svg.AUDIT_CHECKS["svg"](no_svg) and svg.AUDIT_CHECKS["svg_xml"](no_svg) is None
    assert svg.AUDIT_CHECKS["svg"](broken) is None and "not well-formed" in svg.AUDIT_CHECKS["svg_xml"](broken)
    assert "not well-formed" in svg.AUDIT_CHECKS["svg_xml"](as_messages)


def test_side_by_side_png(tmp_path):
    cell = 120
    rows = [
        {"prompt": "A red square", "base": "I cannot draw.", "adapter": GOOD_SVG, "reference": GOOD_SVG},
        {"prompt": "A broken one " * 20, "base": f'<svg {NS}><rect></svg>',
         "adapter": f'<svg {NS} width="0" height="0"/>', "reference": None},
        {"prompt": "A wide blue bar", "base": GOOD_SVG, "adapter": GOOD_SVG,
         "reference": f'<svg {NS} viewBox="0 0 40 10"><rect width="40" height="10" fill="#0000ff"/></svg>'},
    ]
    path = svg.side_by_side_png(rows, tmp_path / "out" / "grid.png", cell=cell, scale=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(path).convert("RGB")
    assert image.size == (4 * cell, svg.HEADER_HEIGHT + 3 * cell)

    def cell_colours(row, column):
        top = svg.HEADER_HEIGHT + row * cell
        crop = image.crop((column * cell, top, (column + 1) * cell, top + cell))
        return {colour for _, colour in crop.getcolors(maxcolors=cell * cell)}

    assert (255, 0, 0) in cell_colours(0, 2)        # the adapter's red square is drawn
    assert (236, 236, 236) in cell_colours(0, 1)    # the base's text gets the "does not render" box
    assert (236, 236, 236) in cell_colours(1, 2)    # so does a zero-size SVG
    assert (255, 0, 0) not in cell_colours(1, 2)
    assert (0, 0, 255) in cell_colours(2, 3)        # the reference column renders too


def test_side_by_side_keeps_an_unbroken_answer_in_its_box_at_twice_the_pixels(tmp_path):
    cell, scale = 120, 2
    rows = [{"prompt": "Draw a zero " + "0" * 200, "base": "0" * 300, "adapter": "I cannot draw.", "reference": None}]
    image = Image.open(svg.side_by_side_png(rows, tmp_path / "grid.png", cell=cell)).convert("RGB")
    assert image.size == (4 * cell * scale, (svg.HEADER_HEIGHT + cell) * scale)  # twice the pixels by default
    top, size, pad = svg.HEADER_HEIGHT * scale, cell * scale, 6 * scale

    def darkest(left, right):  # of the row, above the line under it
        crop = image.crop((left, top, right, top + size - pad))
        return min(min(colour) for _, colour in crop.getcolors(maxcolors=crop.width * crop.height))

    # The text of the prompt and of the base's grey box ends inside them: the strips between the boxes stay white,
    # and the adapter's box shows its own words, not the base's zeros running in from the left.
    assert darkest(size - pad, size + pad) == 255 and darkest(2 * size - pad + scale, 2 * size) == 255
    assert darkest(size, 2 * size) < 100  # ... while the base's box does hold dark text
    adapter_box = image.crop((2 * size, top, 3 * size, top + size))
    assert adapter_box.getpixel((adapter_box.width - 2 * pad, adapter_box.height // 2)) == (236, 236, 236)


# ---------------------------------------------------------------------------------------- Home Assistant

def ha_row(home_assistant_sample):
    return read_rows(home_assistant_sample, 1)[0]


def action(**fields):
    return json.dumps(fields)


def test_home_assistant_metrics_on_the_reference(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    assert home_assistant.metrics(completion_text(row), row) == {
        "valid_json": True, "schema_ok": True, "schema_violations": 0, "invented_entities": 0}


def test_home_assistant_metrics_invalid_json(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    for output in ['{"domain": "light", "service": "turn_on"', "Sure! I turned on the light.", ""]:
        assert home_assistant.metrics(output, row) == {
            "valid_json": False, "schema_ok": False, "schema_violations": 1, "invented_entities": 0}


def test_home_assistant_metrics_wrong_schema(home_assistant_sample):
    row = ha_row(home_assistant_sample)  # its home has cover.kitchen_blinds
    missing_and_extra = action(domain="cover", target={"entity_id": "cover.kitchen_blinds"}, speed=3)
    result = home_assistant.metrics(missing_and_extra, row)
    assert result["valid_json"] is True and result["schema_ok"] is False
    assert result["schema_violations"] == 2  # missing service, unexpected speed
    wrong_domain = action(domain="light", service="turn_on", target={"entity_id": "cover.kitchen_blinds"})
    assert home_assistant.schema_violations(json.loads(wrong_domain)) == [
        "entity cover.kitchen_blinds is not in domain 'light'"]
    bad_types = action(domain="Cover!", service="open_cover", target="cover.kitchen_blinds", data=[1])
    assert home_assistant.metrics(bad_types, row)["schema_violations"] == 3
    assert home_assistant.metrics("[]", row)["schema_violations"] == 1


def test_home_assistant_metrics_invented_entity(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    assert "cover.kitchen_blinds" in home_assistant.context_entities(row)
    invented = action(domain="cover", service="open_cover", target={"entity_id": "cover.attic_blinds"}, data={})
    assert home_assistant.metrics(invented, row) == {
        "valid_json": True, "schema_ok": True, "schema_violations": 0, "invented_entities": 1}
    several = action(domain="cover", service="open_cover",
                     target={"entity_id": ["cover.kitchen_blinds", "cover.attic_blinds", "cover.roof"]})
    assert home_assistant.metrics(several, row)["invented_entities"] == 2


def test_home_assistant_summarise(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    results = [home_assistant.metrics(completion_text(row), row), home_assistant.metrics("nope", row)]
    assert home_assistant.summarise(results) == {
        "outputs": 2, "valid_json": 0.5, "schema_ok": 0.5, "schema_violations": 0.5, "invented_entities": 0.0}


def test_home_assistant_audit_checks(home_assistant_sample):
    rows = read_rows(home_assistant_sample, 240)
    assert [n for row in rows for n, check in home_assistant.AUDIT_CHECKS.items() if check(row)] == []

    def with_answer(answer):
        row = json.loads(json.dumps(rows[0]))
        row["messages"][-1]["content"] = answer
        return row

    def flagged(row):
        return {name: reason for name, check in home_assistant.AUDIT_CHECKS.items() if (reason := check(row))}

    assert list(flagged(with_answer("No valid response from model."))) == ["json"]
    assert list(flagged(with_answer(action(domain="cover", target={"entity_id": "cover.kitchen_blinds"})))) == [
        "schema"]
    invented = flagged(with_answer(action(domain="cover", service="open_cover",
                                          target={"entity_id": "cover.attic_blinds"})))
    assert list(invented) == ["known_entities"] and "cover.attic_blinds" in invented["known_entities"]
    prompt_completion = {"prompt": "Devices: light.desk 'Desk'. Turn on the desk light.",
                         "completion": action(domain="light", service="turn_on", target={"entity_id": "light.desk"})}
    assert flagged(prompt_completion) == {}


def test_load_task():
    assert load_task("svg") is svg and load_task(home_assistant) is home_assistant and load_task(None) is None
    with pytest.raises(FreetuneError, match="svg, home_assistant"):
        load_task("sql")
