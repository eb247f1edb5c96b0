"""SVG generation task: is there an SVG in the output, is it well-formed, does it render, are its tags real SVG?

Rendering uses cairosvg (PyPI `cairosvg`, which needs the system's libcairo2). cairosvg's safe mode is kept:
no XML entities, no external files or URLs, only data: URLs — a generated SVG cannot read or fetch anything.
"""

from __future__ import annotations

import io
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

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
    from cairosvg.helpers import node_format
    from cairosvg.parser import Tree
    from cairosvg.surface import PNGSurface
    from PIL import Image

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
    return parse_svg(block)[1]


# Each defect is reported by one check only (a completion without <svg> is not also "broken XML"), so counts
# per check add up to the rows flagged.
AUDIT_CHECKS = {
    "svg": _has_svg,
    "svg_xml": _svg_parses,
}


def metrics(output: str, row: dict | None = None) -> dict[str, bool]:
    """has_svg_block, well_formed_xml, renders (cairosvg), only_valid_tags, for one generated output.

    Each is False when the one before it fails (no block -> nothing is well-formed), except only_valid_tags,
    which also reads broken XML.
    """
    block = svg_block(output)
    if block is None:
        return {"has_svg_block": False, "well_formed_xml": False, "renders": False, "only_valid_tags": False}
    root, _ = parse_svg(block)
    renders = root is not None and render_svg(block, side=64)[0] is not None
    return {"has_svg_block": True, "well_formed_xml": root is not None, "renders": renders,
            "only_valid_tags": not invalid_tags(block)}


def summarise(results: list[dict]) -> dict[str, float]:
    """Share of outputs with an SVG block, well-formed, rendering, and using only real SVG tags."""
    return summarise_metrics(results)


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
