"""The pure codec: SGLang ``/generate`` answers <-> compact numpy arrays, and compact samples -> bytes.

No I/O and no session state here: every function takes bytes/objects and returns arrays or raises
``UpstreamProtocolError`` (a 502 for the caller) saying exactly what is wrong with the answer.
See docs/protocol.md sections 2-3 for the formats. One module per concern:

- ``answers``: a unary answer (or a stream's final chunk) decoded and checked (``decode_generate_response``);
- ``stream``: SGLang's cumulative SSE chunks turned into deltas (``CumulativeStreamDecoder``);
- ``versions``: which weights produced the tokens (``weight_version``, the per-token ``weight_versions`` spans);
- ``safetensors_writer``: a compact sample as safetensors bytes, written as it is sent.
"""

from __future__ import annotations

from gateway.codec.answers import (
    INT32_MAX,
    ROUTING_STEP_CHARS,
    AnswerBytes,
    DecodedTurn,
    check_top_p_spans,
    cut_raw_string_fields,
    decode_answer,
    decode_generate_response,
    decode_int32_b64,
    decode_int32_b64_run,
    decode_output_token_logprobs,
    narrowest_unsigned,
    parse_json_object,
    unsigned_max,
)
from gateway.codec.safetensors_writer import SafetensorsStream, encode_safetensors, safetensors_stream
from gateway.codec.stream import SSE_DONE, CumulativeStreamDecoder, StreamDelta, answer_rid, stream_error_payload
from gateway.codec.versions import (
    MAX_WEIGHT_VERSION_CHARS,
    MAX_WEIGHT_VERSION_SPANS,
    VersionSpan,
    decode_weight_version_spans,
    read_weight_version,
)

__all__ = [
    "INT32_MAX",
    "MAX_WEIGHT_VERSION_CHARS",
    "MAX_WEIGHT_VERSION_SPANS",
    "ROUTING_STEP_CHARS",
    "SSE_DONE",
    "AnswerBytes",
    "CumulativeStreamDecoder",
    "DecodedTurn",
    "SafetensorsStream",
    "StreamDelta",
    "VersionSpan",
    "answer_rid",
    "check_top_p_spans",
    "cut_raw_string_fields",
    "decode_answer",
    "decode_generate_response",
    "decode_int32_b64",
    "decode_int32_b64_run",
    "decode_output_token_logprobs",
    "decode_weight_version_spans",
    "encode_safetensors",
    "narrowest_unsigned",
    "parse_json_object",
    "read_weight_version",
    "safetensors_stream",
    "stream_error_payload",
    "unsigned_max",
]
