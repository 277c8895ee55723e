"""A tiny RGB canvas that saves itself as a PNG: filled rectangles and bitmap text, nothing else.

Enough to draw pipeline timelines without a plotting library (standard library only: the PNG is
written with zlib and struct). Coordinates are pixels, (0, 0) top left, x to the right.

The font is a 5x7 bitmap drawn for meshloom: each glyph is 7 rows of 5 bits, written as 14 hex
digits (two per row, the row's leftmost pixel is bit 0x10). Text scales by an integer factor;
a character advances 6 x scale pixels.
"""

from __future__ import annotations

import os
import struct
import zlib

Color = tuple[int, int, int]

GLYPH_W, GLYPH_H = 5, 7
ADVANCE = GLYPH_W + 1

_FONT = {
    " ": "00000000000000", "A": "0E11111F111111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1E11111111111E", "E": "1F10101E10101F",
    "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211",
    "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D",
    "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A",
    "X": "11110A040A1111", "Y": "11110A04040404", "Z": "1F01020408101F",
    "a": "00000E010F110F", "b": "1010161911111E", "c": "00000E1010110E",
    "d": "01010D1311110F", "e": "00000E111F100E", "f": "0609081C080808",
    "g": "000F11110F010E", "h": "10101619111111", "i": "04000C0404040E",
    "j": "0200060202120C", "k": "10101214181412", "l": "0C04040404040E",
    "m": "00001A15151111", "n": "00001619111111", "o": "00000E1111110E",
    "p": "00001E111E1010", "q": "00000D130F0101", "r": "00001619101010",
    "s": "00000E100E011E", "t": "08081C08080906", "u": "0000111111130D",
    "v": "00001111110A04", "w": "0000111115150A", "x": "0000110A040A11", "y": "000011110F010E",
    "z": "00001F0204081F", "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F",
    "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E",
    "9": "0E11110F01020C", ".": "00000000000C0C", ",": "000000000C0408",
    ":": "000C0C000C0C00", ";": "000C0C000C0408", "-": "0000001F000000",
    "+": "0004041F040400", "=": "00001F001F0000", "/": "00010204081000",
    "(": "02040808080402", ")": "08040202020408", "%": "18190204081303",
    "#": "0A0A1F0A1F0A0A", "_": "0000000000001F", "[": "0E08080808080E",
    "]": "0E02020202020E", "<": "02040810080402", ">": "08040201020408",
    "!": "04040404040004", "?": "0E110102040004", "'": "04040800000000",
    '"': "0A0A0000000000", "*": "0004150E150400", "|": "04040404040404",
    "@": "0E11171517100E", "&": "0C12140815120D", "~": "00000815020000",
}
_UNKNOWN = "1F11111111111F"  # a hollow box for characters the font lacks


def _rows(ch: str) -> list[int]:
    code = _FONT.get(ch, _UNKNOWN)
    return [int(code[i:i + 2], 16) for i in range(0, 2 * GLYPH_H, 2)]


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of `text` drawn at `scale` (without the spacing after the last glyph)."""
    return max(0, len(text) * ADVANCE * scale - scale)


def text_height(scale: int = 1) -> int:
    return GLYPH_H * scale


class Canvas:
    """An RGB image in memory: `rect`, `text`, then `save`."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        if width < 1 or height < 1:
            raise ValueError(f"canvas size {width}x{height} must be at least 1x1")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i:i + 3])

    def rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas (coordinates are rounded)."""
        x0, x1 = max(0, round(x0)), min(self.width, round(x1))
        y0, y1 = max(0, round(y0)), min(self.height, round(y1))
        if x0 >= x1 or y0 >= y1:
            return
        span = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = 3 * (y * self.width + x0)
            self.pixels[i:i + len(span)] = span

    def frame(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """A one-pixel outline of [x0, x1) x [y0, y1)."""
        self.rect(x0, y0, x1, y0 + 1, color)
        self.rect(x0, y1 - 1, x1, y1, color)
        self.rect(x0, y0, x0 + 1, y1, color)
        self.rect(x1 - 1, y0, x1, y1, color)

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> int:
        """Draw `text` with its top-left corner at (x, y); returns the x after it."""
        for ch in text:
            for row, bits in enumerate(_rows(ch)):
                for col in range(GLYPH_W):
                    if bits & (0x10 >> col):
                        px, py = x + col * scale, y + row * scale
                        self.rect(px, py, px + scale, py + scale, color)
            x += ADVANCE * scale
        return x

    def png_bytes(self) -> bytes:
        """The image as a PNG file: 8-bit RGB, no interlace, filter 0 on every row."""
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride])
                       for y in range(self.height))
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
                + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))

    def save(self, path: str | os.PathLike) -> None:
        """Write the PNG through a temporary file and a rename: never a half-written image."""
        path = os.fspath(path)
        tmp = os.path.join(os.path.dirname(path) or ".",
                           f".{os.path.basename(path)}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(self.png_bytes())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
