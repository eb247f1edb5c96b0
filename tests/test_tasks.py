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


@pytest.mark.parametrize("block", [
    f'<svg {NS}><rect/></svg>', f'<svg {NS}><rect></svg>', f'<svg {NS}><rect', "", "<svg", "plain text",
    f'<svg {NS}><text>a &amp; b &#x41;</text></svg>', f'<svg {NS}><text>&nbsp;</text></svg>',
    f'<svg {NS}><inkscape:g/></svg>', f'<svg {NS} xmlns:i="urn:i"><i:g/></svg>', f'<svg {NS}></svg><svg/>',
    f'<?xml version="1.0" encoding="ISO-8859-1"?><svg {NS}><!-- é --><![CDATA[<x>]]></svg>',
    f'<!DOCTYPE svg [<!ENTITY c "#fff">]><svg {NS} fill="&c;"/>', f'<!DOCTYPE svg SYSTEM "x.dtd"><svg>&d;</svg>',
    f'<svg {NS} a="1" a="2"/>', f'<svg {NS}>\x00</svg>', f'<svg {NS}><p:x xmlns:p=""/></svg>',
])
def test_the_fast_well_formedness_check_says_what_elementtree_says(block):
    assert svg.xml_problem(block) == svg.parse_svg(block)[1]


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
        "valid_json": True, "schema_ok": True, "schema_violations": 0, "invented_entities": 0,
        "service_matches": True, "entities_match": True, "data_matches": True, "action_matches": True}


def test_home_assistant_metrics_invalid_json(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    for output in ['{"domain": "light", "service": "turn_on"', "Sure! I turned on the light.", ""]:
        assert home_assistant.metrics(output, row) == {
            "valid_json": False, "schema_ok": False, "schema_violations": 1, "invented_entities": 0,
            "service_matches": False, "entities_match": False, "data_matches": False, "action_matches": False}


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
    result = home_assistant.metrics(invented, row)
    assert {k: result[k] for k in ("valid_json", "schema_ok", "schema_violations", "invented_entities")} == {
        "valid_json": True, "schema_ok": True, "schema_violations": 0, "invented_entities": 1}
    assert not result["action_matches"]
    several = action(domain="cover", service="open_cover",
                     target={"entity_id": ["cover.kitchen_blinds", "cover.attic_blinds", "cover.roof"]})
    assert home_assistant.metrics(several, row)["invented_entities"] == 2


def test_home_assistant_summarise(home_assistant_sample):
    row = ha_row(home_assistant_sample)
    results = [home_assistant.metrics(completion_text(row), row), home_assistant.metrics("nope", row)]
    assert home_assistant.summarise(results) == {
        "outputs": 2, "valid_json": 0.5, "schema_ok": 0.5, "schema_violations": 0.5, "invented_entities": 0.0,
        "service_matches": 0.5, "entities_match": 0.5, "data_matches": 0.5, "action_matches": 0.5}


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
    assert load_task("") is None  # the parameters cell's "no task"
    with pytest.raises(FreetuneError, match='home_assistant, svg. Set `task` to one of them, or to "" '):
        load_task("sql")


# ------------------------------------------------------------------------- SVG against the reference answer

def sample_svg(size=100, background="#1e88e5", body='<circle cx="50" cy="50" r="30" fill="#e53935"/>'):
    return (f'<svg {NS} width="{size}" height="{size}" viewBox="0 0 {size} {size}">'
            f'<rect width="{size}" height="{size}" fill="{background}"/>{body}</svg>')


ASKED = {"prompt": "Draw a red circle on a blue background, 100 pixels wide.", "completion": sample_svg()}


def test_colour_family_names_colours_as_prompts_do():
    assert [svg.colour_family(c) for c in ("#e53935", "red", "#f00", "rgb(255, 0, 0)")] == ["red"] * 4
    assert [svg.colour_family(c) for c in ("#1e88e5", "navy", "#00897b", "#fdd835", "gold", "#8e24aa", "#d81b60",
                                           "pink", "#757575", "black", "white")] == [
        "blue", "blue", "teal", "yellow", "yellow", "purple", "pink", "pink", "gray", "black", "white"]
    assert svg.colour_family("none") is None and svg.colour_family("url(#gradient)") is None


def test_picture_reads_size_background_colours_and_shapes():
    orange_square = '<rect x="4" y="4" width="9" height="9" style="fill:#fb8c00"/>'
    drawn = svg.picture("Sure: " + sample_svg(64, "black", orange_square))
    assert drawn == svg.Picture(size=(64.0, 64.0), background="black", colours=frozenset({"black", "orange"}),
                                shapes=(("rect", 2),))
    # The size from the viewBox alone; a first element that is not a full-canvas rect is no background.
    assert svg.picture(f'<svg {NS} viewBox="0 0 30 20"><circle r="3" fill="red"/></svg>') == svg.Picture(
        size=(30.0, 20.0), background=None, colours=frozenset({"red"}), shapes=(("circle", 1),))
    assert svg.picture("<svg><rect></svg>") is None and svg.picture("no picture") is None


def test_the_reference_answer_follows_its_prompt():
    result = svg.metrics(ASKED["completion"], ASKED)
    assert result["follows_prompt"] and result["shapes_match"] and result["size_matches"]
    assert result["image_similarity"] == pytest.approx(1.0) and result["shape_similarity"] == 1.0


def test_the_asked_colours_in_other_words_still_follow_the_prompt():
    # Pure red and CSS blue for the reference's #e53935 and #1e88e5, another radius: what was asked, drawn anew.
    answer = sample_svg(background="blue", body='<circle cx="50" cy="50" r="20" fill="#ff0000"/>')
    result = svg.metrics(answer, ASKED)
    assert result["follows_prompt"] and result["colours_match"] and result["shapes_match"]
    assert 0.7 < result["image_similarity"] < 1.0


@pytest.mark.parametrize("answer, failed", [
    (sample_svg(size=128), {"size_matches"}),                                  # another size
    (sample_svg(background="#43a047"), {"background_matches", "colours_match"}),  # green, not blue, behind
    (sample_svg(background="#e53935", body='<circle cx="50" cy="50" r="30" fill="#1e88e5"/>'),
     {"background_matches"}),                                                 # the colours swapped
    (sample_svg(body='<circle cx="50" cy="50" r="30" fill="#e53935"/><rect width="5" height="5" fill="gold"/>'),
     {"colours_match", "shapes_match"}),                                      # something extra, in gold
])
def test_an_answer_that_misses_what_was_asked_does_not_follow_the_prompt(answer, failed):
    result = svg.metrics(answer, ASKED)
    assert result["well_formed_xml"] and result["renders"]  # the format is fine: only the task metrics see it
    assert {name for name in ("size_matches", "background_matches", "colours_match", "shapes_match")
            if not result[name]} == failed
    assert result["follows_prompt"] is False


def test_an_answer_without_a_picture_fails_every_reference_metric():
    result = svg.metrics("I would draw a red circle.", ASKED)
    assert not any(result[k] for k in ("size_matches", "background_matches", "colours_match", "follows_prompt"))
    assert result["image_similarity"] == 0.0


def test_no_reference_no_reference_metrics_and_summaries_skip_what_is_missing():
    assert "follows_prompt" not in svg.metrics(GOOD_SVG, {"prompt": "Draw.", "completion": "not an svg"})
    summary = svg.summarise([svg.metrics(ASKED["completion"], ASKED), svg.metrics(GOOD_SVG, {}),
                             svg.metrics(sample_svg(size=128), ASKED)])
    assert summary["outputs"] == 3 and summary["well_formed_xml"] == 1.0
    assert summary["follows_prompt"] == 0.5  # of the two outputs that had a reference


def test_signature_is_the_picture_not_the_text():
    moved = sample_svg(body='<circle cx="40" cy="60" r="25" fill="#e53935"/>')
    assert svg.signature(moved) == svg.signature(ASKED["completion"]) != svg.signature(sample_svg(size=64))


# ------------------------------------------------------------------ Home Assistant against the reference action

def test_home_assistant_action_against_the_reference(home_assistant_sample):
    row = read_rows(home_assistant_sample, 1)[0]
    action = json.loads(completion_text(row))
    domain = action["domain"]
    other_entity = next(e for e in home_assistant.context_entities(row)
                        if e.startswith(domain + ".") and e != action["target"]["entity_id"])

    def judged(**changes):
        return home_assistant.metrics(json.dumps({**action, **changes}), row)

    assert judged()["action_matches"]
    # Key order, a missing empty data object and a one-element entity list are the same action.
    same = {"service": action["service"], "domain": domain, "target": {"entity_id": [action["target"]["entity_id"]]}}
    if not action["data"]:
        assert home_assistant.metrics(json.dumps(same), row)["action_matches"]
    wrong_entity = judged(target={"entity_id": other_entity})
    assert wrong_entity["service_matches"] and not wrong_entity["entities_match"]
    assert not wrong_entity["action_matches"] and wrong_entity["schema_ok"]  # valid, known, and still wrong
    assert not judged(data={"brightness_pct": 7})["data_matches"]
    assert not judged(service="toggle")["service_matches"]
    assert not home_assistant.metrics("Turning it on!", row)["action_matches"]


def test_any_task_exact_match_and_similarity():
    from freetune.tasks import reference_metrics

    assert reference_metrics("The word  red has 3 letters.", "the word red has 3 letters.") == {
        "exact_match": True, "similarity": 1.0}
    close, far = reference_metrics("The word red has 4 letters.", "The word red has 3 letters."), \
        reference_metrics("Paris.", "The word red has 3 letters.")
    assert not close["exact_match"] and close["similarity"] > 0.9 > 0.3 > far["similarity"]
    assert reference_metrics("anything", None) == {}
