"""SVG generation task: is there an SVG in the output, is it well-formed, does it render, are its tags real SVG,
and does it draw what the prompt asked for: the reference answer's size, background, colours and shapes?

Rendering uses cairosvg (PyPI `cairosvg`, which needs the system's libcairo2). cairosvg's safe mode is kept:
no XML entities, no external files or URLs, only data: URLs — a generated SVG cannot read or fetch anything.
"""

from __future__ import annotations

import functools
import io
import math
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from xml.parsers import expat

from freetune.data import completion_text
from freetune.tasks import summarise_metrics

SVG_NAMESPACE = "http://www.w3.org/2000/svg"

# Every element of SVG 1.1 (Second Edition, appendix "Element Index") and of SVG 2 (Candidate
# Recommendation, adds discard, feDropShadow and unknown). SVG is case-sensitive XML: "lineargradient" is not
# "linearGradient", and a browser ignores it.
SVG_ELEMENTS = frozenset("""
    a altGlyph altGlyphDef altGlyphItem animate animateColor animateMotion animateTransform circle clipPath
    color-profile cursor defs desc discard ellipse feBlend feColorMatrix feComponentTransfer feComposite
    feConvolveMatrix feDiffuseLighting feDisplacementMap feDistantLight feDropShadow feFlood feFuncA feFuncB
    feFuncG feFuncR feGaussianBlur feImage feMerge feMergeNode feMorphology feOffset fePointLight
    feSpecularLighting feSpotLight feTile feTurbulence filter font font-face font-face-format font-face-name
    font-face-src font-face-uri foreignObject g glyph glyphRef hkern image line linearGradient marker mask
    metadata missing-glyph mpath path pattern polygon polyline radialGradient rect script set stop style svg
    switch symbol text textPath title tref tspan unknown use view vkern
""".split())

_SVG_OPEN = re.compile(r"<svg\b")
_SVG_CLOSE = "</svg>"
# Start tags without a namespace prefix: a prefixed tag (inkscape:..., sodipodi:...) is a foreign element,
# which SVG allows.
_START_TAG = re.compile(r"<([A-Za-z_][\w.-]*)(?=[\s/>])")


def svg_block(text: str) -> str | None:
    """The SVG in a text: from the first `<svg` to the last `</svg>` (to the end when it is never closed)."""
    start = _SVG_OPEN.search(text)
    if start is None:
        return None
    end = text.rfind(_SVG_CLOSE)
    return text[start.start():] if end < start.start() else text[start.start():end + len(_SVG_CLOSE)]


def parse_svg(block: str) -> tuple[ET.Element | None, str | None]:
    """(root element, None) when the block is well-formed XML, else (None, the parser's reason)."""
    try:
        return ET.fromstring(block), None
    except ET.ParseError as exc:
        return None, f"not well-formed XML ({exc})"


def xml_problem(block: str) -> str | None:
    """What parse_svg says of the block (None when well-formed, else the parser's reason), without building the
    tree: expat alone, with namespaces on as ElementTree has them, is 2-3x faster on the audit's 100,000 rows. A
    block with a DOCTYPE (whose entities ElementTree resolves its own way) and every block expat refuses go through
    parse_svg, so the reason is ElementTree's own words."""
    if "<!DOCTYPE" not in block:
        try:
            expat.ParserCreate(None, "}").Parse(block, True)
            return None
        except expat.ExpatError:
            pass
    return parse_svg(block)[1]


def _local_name(tag: str) -> tuple[str | None, str]:
    namespace, _, name = tag[1:].partition("}") if tag.startswith("{") else (None, None, tag)
    return namespace, name


def invalid_tags(block: str) -> list[str]:
    """Element names in the block's SVG namespace (or no namespace) that SVG 1.1/2 does not define."""
    root, _ = parse_svg(block)
    if root is not None:
        names = []
        for element in root.iter():
            if not isinstance(element.tag, str):  # comments and processing instructions
                continue
            namespace, name = _local_name(element.tag)
            if namespace in (None, SVG_NAMESPACE):
                names.append(name)
    else:  # broken XML still shows which tags the model invented
        names = _START_TAG.findall(block)
    return sorted({name for name in names if name not in SVG_ELEMENTS})


# What cairosvg's size helper reads from its surface to resolve units: the same numbers it uses, so the size
# found here is the size cairosvg would allocate.
_SIZE_PROBE = SimpleNamespace(dpi=96, font_size=16.0, context_width=None, context_height=None)


def render_svg(block: str, side: int = 256):
    """(PIL RGBA image, None) when cairosvg renders the SVG, else (None, why not).

    The image keeps the SVG's aspect ratio, scaled so its longer side is `side` pixels: drawn at its own size,
    an SVG that says width="30000" would make cairo allocate gigabytes, and a 16-pixel icon would be a speck.
    """
    from PIL import Image

    try:  # without cairo (a GPU image may lack it) the picture is not drawn, and the box says why
        from cairosvg.helpers import node_format
        from cairosvg.parser import Tree
        from cairosvg.surface import PNGSurface
    except (ImportError, OSError) as exc:
        return None, f"cannot render here: cairosvg unavailable ({type(exc).__name__})"
    try:
        tree = Tree(bytestring=block.encode("utf-8"))
        width, height, _ = node_format(_SIZE_PROBE, tree)
        if not (math.isfinite(width) and math.isfinite(height)) or width <= 0 or height <= 0:
            return None, "size undefined (no positive width/height or viewBox)"
        scale = side / max(width, height)
        output = io.BytesIO()
        PNGSurface(tree, output, 96, scale=scale).finish()
        return Image.open(io.BytesIO(output.getvalue())).convert("RGBA"), None
    except Exception as exc:  # cairosvg raises many kinds (ValueError, CairoError, ParseError, ...)
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"


def _has_svg(row: dict) -> str | None:
    return None if _SVG_OPEN.search(completion_text(row)) else "no <svg> in the completion"


def _svg_parses(row: dict) -> str | None:
    block = svg_block(completion_text(row))
    if block is None:  # reported once, by the svg check
        return None
    return xml_problem(block)


# Each defect is reported by one check only (a completion without <svg> is not also "broken XML"), so counts
# per check add up to the rows flagged.
AUDIT_CHECKS = {
    "svg": _has_svg,
    "svg_xml": _svg_parses,
}


def cairo_problem() -> str | None:
    """None when cairosvg can render here, else why not (the cairo C library is missing: apt-get install libcairo2)."""
    try:
        import cairosvg  # noqa: F401  (loads libcairo)
    except (ImportError, OSError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return None


@functools.lru_cache(maxsize=1)
def _can_render() -> bool:
    problem = cairo_problem()
    if problem:  # said once; the metrics that need a render read n/a instead of a made-up False
        print(f"warning: SVG rendering is unavailable ({problem}); renders and image_similarity are n/a. "
              f"Install the cairo library (apt-get install libcairo2) to measure them.", flush=True)
    return problem is None


def _reference(row: dict | None) -> str | None:
    try:
        return completion_text(row) if row else None
    except (KeyError, TypeError):  # a row without an answer has nothing to compare with
        return None


def metrics(output: str, row: dict | None = None) -> dict[str, bool | float | None]:
    """For one generated output: the format (has_svg_block, well_formed_xml, renders, only_valid_tags) and,
    when the row has a reference SVG, the task (reference_metrics: size, background, colours, shapes, image).

    Each format check is False when the one before it fails (no block -> nothing is well-formed), except
    only_valid_tags, which also reads broken XML. Without cairo, renders and image_similarity are None (n/a).
    """
    block = svg_block(output)
    if block is None:
        result = {"has_svg_block": False, "well_formed_xml": False, "renders": False, "only_valid_tags": False}
    else:
        root, _ = parse_svg(block)
        renders = (root is not None and render_svg(block, side=64)[0] is not None) if _can_render() else None
        result = {"has_svg_block": True, "well_formed_xml": root is not None, "renders": renders,
                  "only_valid_tags": not invalid_tags(block)}
    result.update(reference_metrics(output, _reference(row)))
    return result


def summarise(results: list[dict]) -> dict[str, float]:
    """Share of outputs with an SVG block, well-formed, rendering, using only real SVG tags, and (against the
    references) with the asked size, background, colours and shapes; mean shape and image similarity."""
    return summarise_metrics(results)

# ----------------------------------------------------------------------------- against the reference answer
#
# A well-formed SVG is not what the user asked for: an adapter that draws one picture for every prompt passes
# every format check. These compare the answer with the row's reference SVG, which carries what the prompt
# asked for: its size, its background, its colours and its shapes.

DRAWING_ELEMENTS = frozenset("circle ellipse rect line polyline polygon path text image use".split())
_COLOUR_ATTRIBUTES = ("fill", "stroke", "stop-color", "flood-color")
_STYLE_COLOUR = re.compile(r"(?:^|;)\s*(fill|stroke|stop-color|flood-color)\s*:\s*([^;]+)")
_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*(px)?\s*$")
# Hue bins (degrees) of the colour names prompts use; gold and yellow are one family, as are cyan and teal.
_HUE_FAMILIES = ((15, "red"), (40, "orange"), (70, "yellow"), (160, "green"), (195, "teal"), (255, "blue"),
                 (305, "purple"), (345, "pink"), (360, "red"))


def colour_family(value: str) -> str | None:
    """The plain colour name a person would use for a CSS colour ("#e53935" and "red" are both "red"), so an
    answer that paints the asked red as #ff0000 still counts; None for none, gradients and unknown values."""
    from PIL import ImageColor

    try:
        red, green, blue = (c / 255 for c in ImageColor.getrgb(value.strip())[:3])
    except (ValueError, AttributeError):
        return None
    high, low = max(red, green, blue), min(red, green, blue)
    if high - low < 0.15 * max(high, 1e-9) or high - low < 0.08:  # no real hue: a grey
        return "black" if high < 0.2 else "white" if low > 0.9 else "gray"
    if high == red:
        hue = 60 * (((green - blue) / (high - low)) % 6)
    elif high == green:
        hue = 60 * ((blue - red) / (high - low) + 2)
    else:
        hue = 60 * ((red - green) / (high - low) + 4)
    if hue < 15 or hue >= 345:  # light reds are what people call pink
        return "pink" if low > 0.6 else "red"
    return next(name for bound, name in _HUE_FAMILIES if hue < bound)


def _number(value: str | None) -> float | None:
    match = _NUMBER.match(value or "")
    return float(match.group(1)) if match else None


def canvas_size(root: ET.Element) -> tuple[float, float] | None:
    """(width, height) the SVG declares, from its width/height attributes or else its viewBox; None if neither."""
    width, height = _number(root.get("width")), _number(root.get("height"))
    box = [_number(v) for v in re.split(r"[\s,]+", (root.get("viewBox") or "").strip())]
    if len(box) == 4 and None not in box:
        width, height = width if width is not None else box[2], height if height is not None else box[3]
    return (width, height) if width and height else None


def _elements(root: ET.Element):
    return (e for e in root.iter() if isinstance(e.tag, str))


def _colours_of(element: ET.Element) -> list[str]:
    values = [element.get(name) for name in _COLOUR_ATTRIBUTES if element.get(name)]
    values += [m.group(2) for m in _STYLE_COLOUR.finditer(element.get("style") or "")]
    return [family for family in map(colour_family, values) if family]


def background(root: ET.Element, size: tuple[float, float] | None) -> str | None:
    """The colour family of the first drawing element when it is a rect covering the whole canvas (how SVGs
    paint a background); None for a transparent background."""
    first = next((e for e in _elements(root) if _local_name(e.tag)[1] in DRAWING_ELEMENTS), None)
    if first is None or _local_name(first.tag)[1] != "rect" or _number(first.get("x") or "0") or \
            _number(first.get("y") or "0"):
        return None
    covers = all(first.get(side) == "100%" or (size and _number(first.get(side)) == size[k])
                 for k, side in enumerate(("width", "height")))
    colours = _colours_of(first)
    return colours[0] if covers and colours else None


@dataclass(frozen=True)
class Picture:
    """What an SVG draws, in the terms a prompt asks for."""
    size: tuple[float, float] | None
    background: str | None
    colours: frozenset          # colour families used anywhere
    shapes: tuple               # (element name, count) pairs, sorted

    def describe(self) -> str:
        size = "no size" if self.size is None else f"{self.size[0]:g}x{self.size[1]:g}"
        shapes = " ".join(f"{n}x{name}" for name, n in self.shapes) or "nothing"
        return f"{size}, background {self.background or 'none'}, colours {'/'.join(sorted(self.colours)) or 'none'}," \
               f" {shapes}"


def picture(text: str | None) -> Picture | None:
    """The Picture of the SVG in a text; None when there is no well-formed SVG."""
    block = svg_block(text or "")
    root = parse_svg(block)[0] if block is not None else None
    if root is None:
        return None
    size = canvas_size(root)
    shapes = Counter(_local_name(e.tag)[1] for e in _elements(root) if _local_name(e.tag)[1] in DRAWING_ELEMENTS)
    colours = frozenset(c for e in _elements(root) for c in _colours_of(e))
    return Picture(size=size, background=background(root, size), colours=colours,
                   shapes=tuple(sorted(shapes.items())))


def signature(output: str) -> Picture | None:
    """What the answer draws, for counting how many different pictures an adapter gives across prompts."""
    return picture(output)


def shape_similarity(a: Picture, b: Picture) -> float:
    """Shared shapes over all shapes, counting each element (1.0: the same kinds, as many of each)."""
    first, second = Counter(dict(a.shapes)), Counter(dict(b.shapes))
    union = sum((first | second).values())
    return sum((first & second).values()) / union if union else 1.0


def _on_white(image, side: int):
    from PIL import Image

    canvas = Image.new("RGBA", image.size, "white")
    return Image.alpha_composite(canvas, image).convert("RGB").resize((side, side))


@functools.lru_cache(maxsize=256)
def _reference_render(block: str, side: int):
    image = render_svg(block, side=side)[0]
    return None if image is None else _on_white(image, side)


def image_similarity(output_block: str, reference_block: str, side: int = 32) -> float | None:
    """1 - the mean absolute pixel difference of the two drawings, both rendered on white at side x side pixels
    (1.0: the same picture); 0.0 when the answer does not render, None when the reference does not."""
    reference = _reference_render(reference_block, side)
    if reference is None:
        return None
    image = render_svg(output_block, side=side)[0]
    if image is None:
        return 0.0
    from PIL import ImageChops, ImageStat

    difference = ImageStat.Stat(ImageChops.difference(_on_white(image, side), reference)).mean
    return 1 - sum(difference) / (len(difference) * 255)


ADHERENCE = "follows_prompt"
ADHERENCE_MEANS = "the reference's size, background and colours"
SIGNATURE_MEANS = "pictures"  # a picture: its size, background, colours and shapes (Picture)


def reference_metrics(output: str, reference: str | None) -> dict[str, bool | float]:
    """The answer against the reference SVG: size_matches (width/height), background_matches, colours_match
    (the same colour families: #ff0000 for #e53935 counts), shapes_match (the same elements, as many of each),
    shape_similarity, image_similarity (rendered, 1.0 = same pixels) and follows_prompt (size, background and
    colours all match). Empty when the reference is not a well-formed SVG: there is nothing to compare with."""
    wanted = picture(reference)
    if wanted is None:
        return {}
    drawn = picture(output)
    if drawn is None:
        return {"size_matches": False, "background_matches": False, "colours_match": False, "shapes_match": False,
                "shape_similarity": 0.0, "image_similarity": 0.0, ADHERENCE: False}
    size = wanted.size is None or (drawn.size is not None and all(
        math.isclose(d, w, rel_tol=0.01) for d, w in zip(drawn.size, wanted.size)))
    background_ok = drawn.background == wanted.background
    colours = drawn.colours == wanted.colours
    return {"size_matches": size, "background_matches": background_ok, "colours_match": colours,
            "shapes_match": drawn.shapes == wanted.shapes, "shape_similarity": shape_similarity(drawn, wanted),
            "image_similarity": image_similarity(svg_block(output), svg_block(reference)) if _can_render() else None,
            ADHERENCE: size and background_ok and colours}


COLUMNS = ("prompt", "base", "adapter", "reference")
HEADER_HEIGHT = 28  # at scale 1


def _pieces(draw, word: str, font, width: int) -> list[str]:
    """A word wider than the box, cut into pieces that fit: an unbroken answer ("000...") has no space to wrap at."""
    pieces = []
    while len(word) > 1 and draw.textlength(word, font=font) > width:
        fits, too_long = 1, len(word)  # the longest prefix that fits (at least one character)
        while too_long - fits > 1:
            middle = (fits + too_long) // 2
            fits, too_long = (middle, too_long) if draw.textlength(word[:middle], font=font) <= width else (fits, middle)
        pieces.append(word[:fits])
        word = word[fits:]
    return pieces + [word]


def _wrap(draw, text: str, font, width: int) -> list[str]:
    lines, line = [], ""
    for word in (piece for word in text.split() for piece in _pieces(draw, word, font, width)):
        candidate = f"{line} {word}".strip()
        if line and draw.textlength(candidate, font=font) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return lines + ([line] if line else [])


def _draw_text(draw, box: tuple[int, int, int, int], text: str, font, fill) -> int:
    """Text wrapped inside the box, cut with "…" when it does not fit; returns the y below the last line."""
    left, top, right, bottom = box
    line_height = round(font.size * 1.25)
    max_lines = (bottom - top) // line_height
    if max_lines < 1:  # no room left in the box: nothing is drawn past its edge
        return top
    lines = _wrap(draw, text, font, right - left)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and draw.textlength(last + " …", font=font) > right - left:
            last = last[:-1]
        lines[-1] = last + " …"
    for i, line in enumerate(lines):
        draw.text((left, top + i * line_height), line, font=font, fill=fill)
    return top + len(lines) * line_height


def side_by_side_png(rows: list[dict], path: str | Path, cell: int = 192, scale: int = 2) -> Path:
    """One PNG grid: a row per prompt, columns prompt / base / adapter / reference renders.

    rows: dicts with "prompt", "base", "adapter", "reference" (texts; reference may be None). An output that
    does not render gets a grey box saying "does not render" and why. The image is 4 * cell wide and
    HEADER_HEIGHT + len(rows) * cell high, times scale: drawn at twice the pixels by default, for a sharp image
    at its size on a high-density screen (IPython's Image(..., retina=True) shows it at half its pixels).
    """
    from PIL import Image, ImageDraw, ImageFont

    cell, header, pad = cell * scale, HEADER_HEIGHT * scale, 6 * scale
    font = ImageFont.load_default(size=12 * scale)
    title_font = ImageFont.load_default(size=14 * scale)
    image = Image.new("RGB", (len(COLUMNS) * cell, header + len(rows) * cell), "white")
    draw = ImageDraw.Draw(image)
    for c, title in enumerate(COLUMNS):
        draw.text((c * cell + pad, pad), title, font=title_font, fill="black")
    draw.line([(0, header - scale), (image.width, header - scale)], fill="black", width=scale)

    for r, row in enumerate(rows):
        top = header + r * cell
        _draw_text(draw, (pad, top + pad, cell - pad, top + cell - pad), str(row.get("prompt", "")), font, "black")
        for c, column in enumerate(COLUMNS[1:], start=1):
            box = (c * cell + pad, top + pad, (c + 1) * cell - pad, top + cell - pad)
            text = row.get(column)
            if text is None:
                _draw_text(draw, box, "(none)", font, "gray")
                continue
            block = svg_block(text)
            fit = min(box[2] - box[0], box[3] - box[1])
            picture, reason = (None, "no <svg> block") if block is None else render_svg(block, side=fit)
            if picture is None:
                draw.rectangle(box, fill=(236, 236, 236), outline=(160, 160, 160), width=scale)
                inner = (box[0] + pad, box[1] + pad, box[2] - pad, box[3] - pad)
                below = _draw_text(draw, inner, f"does not render: {reason}", font, (150, 0, 0))
                # What the model said instead: a collapsed adapter's stub is seen at a glance.
                excerpt = " ".join(text.split())[:300] or "(empty output)"
                _draw_text(draw, (inner[0], below + pad, inner[2], inner[3]), excerpt, font, (80, 80, 80))
                continue
            left = box[0] + (box[2] - box[0] - picture.width) // 2
            upper = box[1] + (box[3] - box[1] - picture.height) // 2
            image.paste(picture, (left, upper), picture)
            draw.rectangle((left - scale, upper - scale, left + picture.width, upper + picture.height),
                           outline=(200, 200, 200), width=scale)
        draw.line([(0, top + cell - scale), (image.width, top + cell - scale)], fill=(200, 200, 200), width=scale)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path
