"""Streamed events are coalesced without being delayed: what one upstream message produces goes
out in one write (the role chunk with the first delta), and the end of the stream (usage chunk,
[DONE], chunked terminator) in the last one."""

from __future__ import annotations

from aiohttp import web


def test_one_write_per_upstream_message_and_one_for_the_end(gateway, monkeypatch):
    key = gateway.new_org("sse-writes")[2]
    writes: list[bytes] = []
    write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def counted_write(self, data):
        writes.append(bytes(data))
        await write(self, data)

    async def counted_write_eof(self, data=b""):
        if data:                        # aiohttp calls it again, empty, when the handler returns
            writes.append(bytes(data))
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted_write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", counted_write_eof)
    with gateway.http.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "fake-model", "stream": True, "stream_options": {"include_usage": True},
                                   "messages": [{"role": "user", "content": "[words:3]"}]}) as reply:
        body = b"".join(reply.iter_bytes())

    assert b"".join(writes) == body
    assert all(w.endswith(b"\n\n") for w in writes)                 # whole events only
    assert len(writes) <= 3 + 1                                     # 3 upstream messages, then the end
    assert b'"role":"assistant"' in writes[0] and b'"usage":{' not in writes[0]
    assert b'"choices":[],"usage":{' in writes[-1] and writes[-1].endswith(b"data: [DONE]\n\n")
