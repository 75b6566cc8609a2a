"""Image files damaged as a file changed after validation is."""


def undecodable_png(path, size=(56, 56)) -> None:
    """A PNG whose header and chunk checksums are sound (the validation pass's checks) but whose pixel data is
    garbage: it fails only when decoded, as a file damaged after validation does."""
    import io
    import struct
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    at = data.find(b"IDAT")
    length = struct.unpack(">I", data[at - 4:at])[0]
    payload = bytes(b ^ 0x5A if k >= 2 else b for k, b in enumerate(data[at + 4:at + 4 + length]))
    data[at + 4:at + 4 + length] = payload
    data[at + 4 + length:at + 8 + length] = struct.pack(">I", zlib.crc32(b"IDAT" + payload))
    with open(path, "wb") as f:
        f.write(data)
