"""A compressed request body (HTTP ``Content-Encoding``, a gRPC message's ``grpc-encoding``) inflated with
the server's size limit applied to what comes out, not to what came in: a few hundred kilobytes of deflate
expand to gigabytes (gzip.decompress and zlib.decompress have no limit). Inflating stops one byte past the
limit, so a bomb costs at most the limit in memory. The standard library's zlib does the work."""

from __future__ import annotations

import zlib

from azulite.errors import InvalidArgument, PayloadTooLarge, Unsupported

#: zlib window bits: gzip's framing (HTTP gzip, gRPC gzip), zlib's (HTTP "deflate", RFC 9110; gRPC deflate)
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}


def inflate(data: bytes, encoding: bytes, limit: int, *, what: str = "request body", flag: str = "") -> bytes:
    """``data`` decompressed per ``encoding``; PayloadTooLarge past ``limit`` bytes, InvalidArgument when it
    is not that encoding's data (or is cut short), Unsupported for an encoding other than gzip or deflate."""
    wbits = _WBITS.get(encoding.lower())
    if wbits is None:
        raise Unsupported(f"Content-Encoding {encoding.decode(errors='replace')!r} is not supported",
                          fix="send gzip, deflate or an uncompressed body")
    out = bytearray()
    rest = data
    try:
        while True:  # gzip allows several members one after another (gzip.decompress reads them all)
            d = zlib.decompressobj(wbits)
            out += d.decompress(rest, limit - len(out) + 1)
            if len(out) > limit or d.unconsumed_tail:
                raise PayloadTooLarge(f"the {what} inflates past the server's limit of {limit} bytes",
                                      fix=f"send it smaller{f' or raise {flag}' if flag else ''}")
            if not d.eof:
                raise InvalidArgument(f"the {what} is cut short: not complete {encoding.decode()} data")
            rest = d.unused_data
            if not rest or wbits != _WBITS[b"gzip"]:
                break
    except zlib.error as exc:
        raise InvalidArgument(f"the {what} is not valid {encoding.decode()} data: {exc}") from None
    if rest:
        raise InvalidArgument(f"the {what} has {len(rest)} bytes after its {encoding.decode()} data")
    return bytes(out)
