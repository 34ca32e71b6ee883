"""SentencePiece segmentation of raw text for GGUF "llama" vocabularies (tokenizer.py does the rest).

The ``sentencepiece`` library segments with a model assembled in memory from the GGUF vocabulary:
a hand-serialized ``ModelProto`` (just enough of protobuf's wire format, field numbers from
sentencepiece_model.proto; no protobuf dependency). Every piece but the byte pieces is given to
sentencepiece as NORMAL, because llama.cpp's merge loop looks pieces up by text whatever their type
(sentencepiece would otherwise keep CONTROL/UNKNOWN pieces out of merges, resegment UNUSED ones and
force USER_DEFINED ones).
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
import sentencepiece

from .errors import MlxLlamaError


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL_VARINTS[n]
    if n < 0:
        n += 1 << 64  # int32/int64 negatives are 10-byte two's complement varints
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_SMALL_VARINTS = [bytes((i,)) for i in range(0x80)]


def _field_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(int(value))


def _field_bytes(field: int, payload: bytes) -> bytes:
    return _varint((field << 3) | 2) + _varint(len(payload)) + payload


_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_BYTE = 1, 2, 3, 6
_BPE = 2


def _piece_message(text: bytes, score_f32: bytes, sp_type: int) -> bytes:
    # SentencePiece { string piece = 1; float score = 2; Type type = 3; }
    body = _field_bytes(1, text) + b"\x15" + score_f32 + _field_varint(3, sp_type)
    return _field_bytes(1, body)  # ModelProto.pieces = 1


def _model_proto(pieces: list[bytes], *, byte_fallback: bool, unk_id: int) -> bytes:
    trainer = b"".join([
        _field_varint(3, _BPE),                # model_type
        _field_varint(4, unk_id + 1),          # vocab_size
        _field_varint(35, byte_fallback),      # byte_fallback
        _field_varint(40, unk_id),             # unk_id
        _field_varint(41, -1),                 # bos_id: BOS/EOS are handled here, not by sp
        _field_varint(42, -1),                 # eos_id
        _field_varint(43, -1),                 # pad_id
    ])
    normalizer = b"".join([
        _field_bytes(1, b"identity"),          # name: no NFKC, no charsmap
        _field_varint(3, False),               # add_dummy_prefix: done per fragment, below
        _field_varint(4, False),               # remove_extra_whitespaces
        _field_varint(5, True),                # escape_whitespaces: " " -> "▁"
    ])
    return b"".join(pieces) + _field_bytes(2, trainer) + _field_bytes(3, normalizer)


def byte_of_piece(text: str) -> int | None:
    """The byte a piece such as "<0x0A>" stands for, else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


class SentencePieceEncoder:
    """Raw text -> ids over a vocabulary of `texts` (llama.cpp's token texts) with their scores.

    `byte_types` marks the BYTE-typed pieces; with all 256 of them the model falls back to bytes
    for text no piece covers, and without, such text becomes `unk_id` (0 when None).
    """

    def __init__(self, texts: Sequence[str], scores: np.ndarray, byte_types: np.ndarray, unk_id: int | None):
        n = len(texts)
        byte_ids = {}
        for i in np.flatnonzero(byte_types):
            b = byte_of_piece(texts[i])
            # sentencepiece accepts only the exact "<0x0A>" spelling as a byte piece
            if b is not None and texts[i] == f"<0x{b:02X}>":
                byte_ids[b] = int(i)
        self.byte_fallback = len(byte_ids) == 256
        byte_piece_ids = set(byte_ids.values()) if self.byte_fallback else set()
        self.unk_id = unk_id if unk_id is not None else 0

        score_bytes = scores.astype("<f4").tobytes()
        parts = []
        for i in range(n):
            data = texts[i].encode("utf-8")
            sp_type = _SP_BYTE if i in byte_piece_ids else _SP_NORMAL
            if len(data) >= 8000:  # sentencepiece's limit; such a piece can't be produced anyway
                data, sp_type = f"\uf8ff<mlxllama-long-{i}>\uf8ff".encode(), _SP_CONTROL
            parts.append(_piece_message(data, score_bytes[4 * i:4 * i + 4], sp_type))
        # sentencepiece needs exactly one UNKNOWN piece: a synthetic, unreachable one at the end
        # (llama.cpp lets <unk> and other UNKNOWN-typed tokens merge like normal pieces).
        unk_text = "\uf8ff<mlxllama-unk>\uf8ff"
        present = set(texts)
        while unk_text in present:
            unk_text += "\uf8ff"
        parts.append(_piece_message(unk_text.encode(), struct.pack("<f", 0.0), _SP_UNKNOWN))
        self.sp_unk = n
        proto = _model_proto(parts, byte_fallback=self.byte_fallback, unk_id=n)
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
            raise MlxLlamaError(f"could not build the SentencePiece tokenizer: {e}") from None

    def encode(self, text: str) -> list[int]:
        ids = self.sp.encode(text)
        if not self.byte_fallback and self.sp_unk in ids:
            ids = [self.unk_id if t == self.sp_unk else t for t in ids]
        return ids
