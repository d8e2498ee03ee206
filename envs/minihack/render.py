"""NLE observation -> text: the map, its legend and the position line of a MiniHack observation.

Facts used (read in the upstream sources named, NLE 1.3.0 / minihack 1.0.2):

* ``nle/nethack/nethack.py`` (``DUNGEON_SHAPE``, ``GLYPH_CMAP_OFF``, ``MAX_GLYPH``) and NetHack 3.6
  ``include/defsym.h``: cmap glyph ``GLYPH_CMAP_OFF + i`` is map symbol ``i``; 0 is S_stone (what
  ``glyphs`` holds for unseen cells, and everywhere after the game is over), 13/14 the open doors,
  15/16 the closed doors, 34 lava (checked against ``screen_descriptions``).
* ``minihack/base.py`` / ``nle``: open doors are drawn like walls in ``chars`` (``|``/``-``), so they
  are taken from ``glyphs`` and drawn as ``'``; lava is drawn ``}`` like water and is redrawn ``~``.
* ``screen_descriptions`` (21x79x80 bytes, NUL-padded) names what is drawn in a cell; the legend
  takes each symbol's meaning from it (read once per glyph and episode; two things drawn alike are
  listed as "a or b").
* NLE returns views into buffers it reuses, and after the last step of a game ``chars``/``glyphs``/
  ``blstats`` are blank (zeros): :meth:`MapRenderer.capture` renders right away and keeps the last
  non-blank frame.

Text of a frame (``view="full"``: the seen part of the map trimmed to its bounding box; ``"crop"``:
the 9x9 cells around the agent, like MiniHack's ``chars_crop``, unseen/outside cells blank)::

    Map (row 0 is the top):
    @....
    ....>
    Legend: @ you, > stairs down (goal), . floor
    You are at row 0, column 0. Stairs down at row 1, column 4.

Row/column are relative to the map shown.
"""

from __future__ import annotations

import sys

import numpy as np
from nle import nethack

__all__ = ["CROP", "MapRenderer", "decode_text", "offset_sentence"]

_CMAP = nethack.GLYPH_CMAP_OFF
#: cmap indices (NetHack 3.6 ``defsym.h`` order, checked against ``screen_descriptions``).
_CMAP_OPEN_DOORS = (13, 14)        # S_vodoor, S_hodoor: drawn '-'/'|' in chars
_CLOSED_DOOR_GLYPHS = [_CMAP + 15, _CMAP + 16]  # S_vcdoor, S_hcdoor: drawn '+'
_LAVA_GLYPH, _LAVA = _CMAP + 34, "~"  # S_lava: drawn '}' like water in chars; redrawn '~'
_OPEN_DOOR = "'"
_BLANK_GLYPH = _CMAP  # S_stone: what glyphs hold for unseen cells (and everywhere after game over)

#: Screen description -> short legend text.
_RENAME: dict[str, str] = {
    "floor of a room": "floor", "dark part of a room": "floor", "doorway": "floor",
    "broken door": "floor", "staircase down": "stairs down (goal)",
    "staircase up": "stairs up", "open door": "open door", "closed door": "closed door",
    "wall": "wall", "corridor": "corridor", "water": "water", "molten lava": "lava",
}
_LEGEND_FIRST = ("@", ">")
#: Side of the square shown by ``view="crop"`` (cells), centred on the agent.
CROP = 9

# Lookup tables (built once; every frame does a few table look-ups, no per-cell Python work).
_SCREEN_H, _SCREEN_W = (int(n) for n in nethack.DUNGEON_SHAPE)
#: chars byte -> drawn byte: NUL (never drawn) becomes a blank.
_CHAR_FIX = np.arange(256, dtype=np.uint8)
_CHAR_FIX[0] = 32
#: glyph -> byte drawn instead of its char (0: keep the char): open doors and lava.
_GLYPH_SYM = np.zeros(nethack.MAX_GLYPH + 1, dtype=np.uint8)
_GLYPH_SYM[[_CMAP + c for c in _CMAP_OPEN_DOORS]] = ord(_OPEN_DOOR)
_GLYPH_SYM[_LAVA_GLYPH] = ord(_LAVA)
#: glyph -> 1 for doors (open or closed), remembered for the "in a doorway" remark.
_GLYPH_DOOR = np.zeros(nethack.MAX_GLYPH + 1, dtype=np.uint8)
_GLYPH_DOOR[[_CMAP + c for c in _CMAP_OPEN_DOORS] + _CLOSED_DOOR_GLYPHS] = 1

# Glyph ids: the k-th glyph seen in an episode gets the 2-byte id (1 + k % 127, 0x80 + k // 127) (a
# uint16 stored as those bytes), so that the cells of a glyph are found with bytes.find on the id
# bytes of the view. First bytes are in 0x01..0x7F and second bytes in 0x80..0xFE, so a match can only
# start at an even offset, i.e. on a cell; 127 * 127 ids cover every glyph, so an episode never runs
# out of them. While an episode has at most _ONE_BYTE_IDS glyphs their first bytes differ, and the
# first byte alone is searched for (a single-byte find is the fastest).
_ONE_BYTE_IDS = 127
#: id of a glyph not seen yet in the episode: bytes 0x00 0xFF, so that a byte 0x00 is found only in
#: the id of a new glyph
_NEW_ID = int.from_bytes(b"\x00\xff", sys.byteorder)
if nethack.MAX_GLYPH + 1 > 127 * 127:  # 5977 glyphs in NLE 1.3.0
    raise ImportError(f"{nethack.MAX_GLYPH + 1} NLE glyphs do not fit in the 2-byte glyph ids")
#: drawn byte -> 0x80 for a blank (or NUL) cell, 0x00 for a drawn one: ORed into the first byte of a
#: cell's id, it turns an undrawn cell's id into one that matches no glyph (first id bytes are < 0x80)
_UNDRAWN = bytes(0x80 if b in (0, 32) else 0 for b in range(256))
#: legend text of a ``meanings`` dict (as ``tuple(meanings.items())``); few distinct ones occur.
_LEGEND_CACHE: dict[tuple[tuple[str, str], ...], str] = {}


def _glyph_id(k: int) -> bytes:
    """The bytes of the ``k``-th glyph id of an episode (``k`` from 0): 0x01..0x7F, then 0x80..0xFE."""
    return bytes((1 + k % 127, 0x80 + k // 127))


def _clean_description(desc: str) -> str:
    """``"a key named The Master Key of Thievery"`` -> ``"key"``; known terrain renamed."""
    desc = desc.strip()
    if desc in _RENAME:
        return _RENAME[desc]
    for article in ("a ", "an ", "the "):
        if desc.startswith(article):
            desc = desc[len(article):]
            break
    for cut in (" named ", " called "):
        if cut in desc:
            desc = desc.split(cut, 1)[0]
    desc = _RENAME.get(desc, desc)
    return desc[:30] or "?"


def decode_text(arr: np.ndarray) -> str:
    """The text of a NUL-padded ``uint8`` array of any shape (an NLE ``message`` (256,) or one cell of
    ``screen_descriptions`` (80,)): bytes up to the first NUL, decoded as Latin-1, whitespace
    collapsed to single blanks; ``""`` when the first byte is NUL."""
    raw = arr.tobytes()
    if not raw or not raw[0]:  # (most messages are empty)
        return ""
    raw = raw.split(b"\0", 1)[0]
    return " ".join(raw.decode("latin-1").split())


def _bounding_box(raw: bytes, chars: np.ndarray) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the smallest box holding every cell of ``chars`` that is not NUL or blank.

    The same box as ``np.nonzero((chars != 32) & (chars != 0))`` gives, found with byte-string
    stripping (much cheaper than numpy on a 21x79 screen): the first and last drawn byte in row-major
    order give the rows, then in column-major order within those rows the columns. ``raw`` is
    ``chars.tobytes()``; ``chars`` must have a drawn cell.
    """
    w = chars.shape[1]
    # bytes.strip() without an argument is fast but strips all ASCII whitespace (\t\n\v\f\r too);
    # only blanks (and NULs, replaced by blanks) count as empty cells here
    exact = b"\t" in raw or b"\n" in raw or b"\x0b" in raw or b"\x0c" in raw or b"\r" in raw
    flat = raw.replace(b"\0", b" ")
    if exact:
        left, right = len(flat) - len(flat.lstrip(b" ")), len(flat.rstrip(b" "))
    else:
        left, right = len(flat) - len(flat.lstrip()), len(flat.rstrip())
    y0, y1 = left // w, (right - 1) // w + 1
    band = chars[y0:y1].T.tobytes().replace(b"\0", b" ")  # column-major, rows y0..y1-1 only
    if exact:
        left, right = len(band) - len(band.lstrip(b" ")), len(band.rstrip(b" "))
    else:
        left, right = len(band) - len(band.lstrip()), len(band.rstrip())
    bh = y1 - y0
    return y0, y1, left // bh, (right - 1) // bh + 1


def _add_meaning(meanings: dict[str, str], sym: str, glyph: int, cache: dict[int, str],
                 obs: dict[str, np.ndarray], row: int, col: int) -> None:
    """Record what ``sym`` means (NLE's screen description of ``glyph`` at ``(row, col)``, cached per
    glyph); two things drawn with the same symbol are listed as "a or b"."""
    meaning = cache.get(glyph)
    if meaning is None:
        meaning = cache[glyph] = _clean_description(decode_text(obs["screen_descriptions"][row, col]))
    if sym not in meanings:
        meanings[sym] = meaning
    elif meaning not in meanings[sym].split(" or "):
        meanings[sym] += " or " + meaning


def _legend(meanings: dict[str, str]) -> str:
    """``{'@': 'you', '|': 'wall', '-': 'wall'}`` -> ``"@ you, | - wall"`` (``@``, ``>`` first)."""
    order = [s for s in _LEGEND_FIRST if s in meanings] + \
            sorted((s for s in meanings if s not in _LEGEND_FIRST), key=lambda s: (meanings[s], s))
    groups: dict[str, list[str]] = {}
    for s in order:
        groups.setdefault(meanings[s], []).append(s)
    return ", ".join(f"{' '.join(syms)} {meaning}" for meaning, syms in groups.items())


def offset_sentence(dr: int, dc: int) -> str:
    """``The stairs down are 3 south and 2 east of you (direction: southeast).`` for a goal ``dr``
    rows below and ``dc`` columns right of the agent (negative: north / west); ``... are here.`` for
    (0, 0).  The direction is the compass move that shortens the way whenever no wall is between."""
    parts = []
    if dr:
        parts.append(f"{abs(dr)} {'south' if dr > 0 else 'north'}")
    if dc:
        parts.append(f"{abs(dc)} {'east' if dc > 0 else 'west'}")
    if not parts:
        return "The stairs down are here."
    way = ("north" if dr < 0 else "south" if dr > 0 else "") + ("west" if dc < 0 else "east" if dc > 0 else "")
    return f"The stairs down are {' and '.join(parts)} of you (direction: {way})."


class MapRenderer:
    """Renders the NLE observations of one episode at a time as text (map, legend, position line).

    Args:
        view: ``"full"`` (the seen map trimmed to its bounding box) or ``"crop"`` (the
            :data:`CROP` x :data:`CROP` cells around the agent, blank outside the screen).
        goal_offset: when the stairs are in view, add :func:`offset_sentence` to the position line.

    Attributes:
        frame: text of the last non-blank frame (``""`` after :meth:`reset`, before a capture).
        agent_xy: ``(x, y)`` screen cell of the agent (``blstats`` 0 and 1) in that frame; ``None``
            before the first capture (kept over :meth:`reset`).
        doors: ``(x, y)`` screen cells of the doors (open or closed, drawn or not) seen in the episode.

    Raises:
        ValueError: ``view`` is neither ``"full"`` nor ``"crop"``.

    The observation dict must hold ``chars`` (21x79 uint8), ``glyphs`` (21x79 int16), ``blstats`` and
    ``screen_descriptions`` (21x79x80 uint8), NLE's keys and shapes; the arrays are read in place
    (not copied), so they may be NLE's reused buffers.
    """

    def __init__(self, view: str = "full", goal_offset: bool = False) -> None:
        if view not in ("full", "crop"):
            raise ValueError(f"view must be 'full' or 'crop', got {view!r}")
        self.view = view
        self.goal_offset = bool(goal_offset)
        self.frame = ""
        self.agent_xy: tuple[int, int] | None = None
        self.doors: set[tuple[int, int]] = set()
        self._desc_cache: dict[int, str] = {}
        self._pad: tuple[np.ndarray, np.ndarray] | None = None
        # per episode: glyph -> id (see the module's tables), (glyph, id bytes) of the glyphs seen,
        # and the bytes searched for: (glyph, needle) sorted by glyph, the needles of the glyphs
        # redrawn (open doors, lava) and of the doors
        self._ids = np.full(nethack.MAX_GLYPH + 1, _NEW_ID, dtype=np.uint16)
        self._seen: list[tuple[int, bytes]] = []
        self._needles: list[tuple[int, bytes]] = []
        self._redraw_needles: list[bytes] = []
        self._door_needles: list[bytes] = []

    def reset(self) -> None:
        """Start a new episode: forget the frame, the doors, the glyph ids and descriptions."""
        self._desc_cache.clear()
        self._ids.fill(_NEW_ID)
        self._seen.clear()
        self._needles.clear()
        self._redraw_needles.clear()
        self._door_needles.clear()
        self.doors.clear()
        self.frame = ""

    def capture(self, obs: dict[str, np.ndarray]) -> bool:
        """Render ``obs`` into :attr:`frame` (kept as is when the frame is blank).

        Returns ``False`` (and changes nothing) when the frame is blank (the game is over). Only the
        map region shown is looked at, and a screen description is read for one cell of a glyph, the
        first time the glyph is named in the episode's legend.
        """
        chars = obs["chars"]
        raw = chars.tobytes()
        if not raw.strip(b"\0"):  # the game is over: NLE blanked the buffers, keep the previous frame
            return False
        glyphs = obs["glyphs"]
        blstats = obs["blstats"]
        x, y = blstats.item(0), blstats.item(1)
        self.agent_xy = (x, y)
        if self.view == "crop":
            r = CROP // 2
            y0, x0 = y - r, x - r
            y1, x1 = y + r + 1, x + r + 1
            if y0 < 0 or x0 < 0 or y1 > _SCREEN_H or x1 > _SCREEN_W:
                # part of the crop is off the screen: pad with blanks (unseen stone)
                pc, pg = self._padded_buffers()
                pc[r:r + _SCREEN_H, r:r + _SCREEN_W] = chars
                pg[r:r + _SCREEN_H, r:r + _SCREEN_W] = glyphs
                cg, gg = pc[y0 + r:y1 + r, x0 + r:x1 + r], pg[y0 + r:y1 + r, x0 + r:x1 + r]
            else:
                cg, gg = chars[y0:y1, x0:x1], glyphs[y0:y1, x0:x1]
        else:
            y0, y1, x0, x1 = _bounding_box(raw, chars)
            cg, gg = chars[y0:y1, x0:x1], glyphs[y0:y1, x0:x1]
        gh, gw = y1 - y0, x1 - x0
        # the id of each cell's glyph, 2 bytes per cell (the needles of the glyphs are found on cells)
        ids = self._ids.take(gg)
        id_bytes = ids.tobytes()
        if b"\0" in id_bytes:  # glyphs new in this episode
            self._assign_ids(gg)
            ids = self._ids.take(gg)
            id_bytes = ids.tobytes()
        # doors in view (drawn or not) are remembered; open doors and lava are redrawn
        redraw = False
        for b in self._redraw_needles:
            if b in id_bytes:
                redraw = True
                break
        for b in self._door_needles:
            i = id_bytes.find(b)
            while i >= 0:
                c = i >> 1
                self.doors.add((c % gw + x0, c // gw + y0))
                i = id_bytes.find(b, i + 2)
        if redraw or b"\0" in raw:
            grid = _CHAR_FIX.take(cg)  # a fresh (gh, gw) array: NUL drawn as blank
            if redraw:
                sym = _GLYPH_SYM.take(gg)
                np.copyto(grid, sym, where=sym != 0)
        else:
            grid = cg  # nothing to redraw: read the buffer in place
        drawn = grid.tobytes()
        text = drawn.decode("latin-1")
        ar, ac = y - y0, x - x0
        agent_i = ar * gw + ac if 0 <= ar < gh and 0 <= ac < gw else -1
        # legend: one meaning per symbol, from the first drawn cell (row-major) of each glyph,
        # glyphs in increasing order; '@' at the agent is "you" (its glyph is named from another
        # cell, if any). Undrawn cells match no glyph: 0x80 is ORed into the first byte of their ids
        # (utf-16-le turns each mask byte m into m 0x00; big integers are cheaper than numpy here)
        if b" " in drawn:
            undrawn = drawn.translate(_UNDRAWN).decode("latin-1").encode("utf-16-le")
            id_bytes = (int.from_bytes(id_bytes, "big") | int.from_bytes(undrawn, "big")).to_bytes(len(id_bytes),
                                                                                                  "big")
        meanings: dict[str, str] = {}
        cache = self._desc_cache
        for g, b in self._needles:
            i = id_bytes.find(b)
            if i < 0:
                continue
            c = i >> 1
            sym = text[c]
            if c == agent_i and sym == "@":
                i = id_bytes.find(b, i + 2)  # the glyph's second cell
                if i < 0:
                    continue
                c = i >> 1
            _add_meaning(meanings, sym, g, cache, obs, c // gw + y0, c % gw + x0)
        if agent_i >= 0 and text[agent_i] == "@":
            meanings["@"] = "you" + (f" or {meanings['@']}" if "@" in meanings else "")
        rows = [text[k:k + gw].rstrip() for k in range(0, gh * gw, gw)]
        key = tuple(meanings.items())
        legend = _LEGEND_CACHE.get(key)
        if legend is None:
            if len(_LEGEND_CACHE) >= 4096:
                _LEGEND_CACHE.clear()
            legend = _LEGEND_CACHE[key] = _legend(meanings)
        pos = f"You are at row {ar}, column {ac}" + \
            (" (in a doorway: no diagonal moves)." if (x, y) in self.doors else ".")
        k = text.find(">")
        if k >= 0:
            pos += f" Stairs down at row {k // gw}, column {k % gw}."
            if self.goal_offset:
                pos += " " + offset_sentence(k // gw - ar, k % gw - ac)
        self.frame = "\n".join(["Map (row 0 is the top):", *rows, f"Legend: {legend}", pos])
        return True

    def _assign_ids(self, gg: np.ndarray) -> None:
        """Give the glyphs of ``gg`` that have none yet the next ids of the episode; update the
        needles (the first id byte alone while the episode has at most ``_ONE_BYTE_IDS`` glyphs)."""
        for g in sorted(set(gg[self._ids.take(gg) == _NEW_ID].tolist())):
            b = _glyph_id(len(self._seen))
            self._ids[g] = int.from_bytes(b, sys.byteorder)  # stored as these bytes
            self._seen.append((g, b))
        self._seen.sort()
        cut = 1 if len(self._seen) <= _ONE_BYTE_IDS else 2
        self._needles = [(g, b[:cut]) for g, b in self._seen]
        self._redraw_needles = [b for g, b in self._needles if _GLYPH_SYM[g]]
        self._door_needles = [b for g, b in self._needles if _GLYPH_DOOR[g]]

    def _padded_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """Screen-sized chars/glyphs buffers with a blank border of half a crop (crop view)."""
        if self._pad is None:
            r = CROP // 2
            self._pad = (np.full((_SCREEN_H + 2 * r, _SCREEN_W + 2 * r), 32, dtype=np.uint8),
                         np.full((_SCREEN_H + 2 * r, _SCREEN_W + 2 * r), _BLANK_GLYPH,
                                 dtype=np.int16))
        return self._pad
