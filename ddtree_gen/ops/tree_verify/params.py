"""The parameter list of the tensor-core tree_verify kernels, declared once: (C type, name, note) entries from which
the CUDA signature is rendered (the template's `params`: templates/verify_blocks.j2, by `signature`) and the launch is
bound by name (ops/tree_verify/tensor_core.bind: its values by name, never by position).

ATTENTION is every such kernel's list (mma.sync and wgmma); a build's record lists its own (its `params`: ATTENTION,
then the parts grid's request spans SPANS, a TMA build's tensor map KV_MAP). A new parameter is one entry in a
record's list, one use in the template and one value by name (the launch's, or the record's launch_grid).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    ctype: str          # its C type, e.g. "const bf16_t* __restrict__", "int", "const __grid_constant__ TmaMap"
    name: str
    note: str = ""      # the comment after it in the signature ("": it shares a line with the note-less ones beside it)
    note_at_close: bool = False   # its note goes after the closing parenthesis (where the first signature had it)


ATTENTION = (
    Param("const bf16_t* __restrict__", "q_nope", "[B, Nq, H, R]"),
    Param("const bf16_t* __restrict__", "q_pe", "[B, Nq, H, P]"),
    Param("const kv_t* __restrict__", "kv_cache", "[num_pages, PAGE, R + P] bf16 or e4m3 bytes"),
    Param("const int* __restrict__", "block_table", "[B, max_pages]"),
    Param("const int* __restrict__", "prefix_lens", "[B]"),
    Param("const int* __restrict__", "q_lens", "[B]"),
    Param("const uint32_t* __restrict__", "tree_mask", "[B, Nq, W]"),
    Param("float", "scale_log2", "softmax_scale * kv_scale * log2(e)"),
    Param("float", "v_scale", "kv_scale (1 for a bf16 cache): output factor, in fp32"),
    Param("int", "Nq"), Param("int", "max_pages"), Param("int", "num_pages"), Param("int", "splits"),
    Param("long long", "rows_total"),
    Param("bf16_t* __restrict__", "out", "[B, Nq, H, R]            (splits == 1)"),
    Param("float* __restrict__", "lse", "[B, Nq, H]               (splits == 1)"),
    Param("float* __restrict__", "part_o", "[splits, rows_total, R]  (splits > 1)"),
    Param("float* __restrict__", "part_lse", "[splits, rows_total]     (splits > 1)", note_at_close=True),
)
SPANS = Param("int* __restrict__", "spans", "[2 B + 1] (splits > 1): each request's key-tile range, the total")
KV_MAP = Param("const __grid_constant__ TmaMap", "kv_map")


NOTE_COLUMN = 41       # the notes' column after the indent
INDENT = " " * 12      # the continuation lines' (the first follows "<entry>(")
CLOSE_GAP = " " * 12   # between the closing parenthesis and a note_at_close


def render(plist) -> str:
    """The signature's parameter text between "<entry>(" and the body: one line per noted parameter (its note at
    NOTE_COLUMN), note-less neighbours on one line, then ")" and the note_at_close one's note."""
    lines, run, close = [], [], ""
    for i, p in enumerate(plist):
        text = f"{p.ctype} {p.name}" + ("," if i + 1 < len(plist) else "")
        if p.note_at_close:
            close = f"{CLOSE_GAP}// {p.note}"
        if p.note and not p.note_at_close:
            if run:
                lines.append(" ".join(run))
                run = []
            if i + 1 == len(plist):   # the last one (the parts grid's spans without a tensor map): ")" before its note
                return f"\n{INDENT}".join(lines + [f"{(text + ')').ljust(NOTE_COLUMN)}// {p.note}"]) + close
            lines.append(f"{text.ljust(NOTE_COLUMN)}// {p.note}")
        else:
            run.append(text)
            if p.note_at_close or i + 1 == len(plist) or plist[i + 1].note:
                lines.append(" ".join(run))
                run = []
    return f"\n{INDENT}".join(lines) + ")" + close


def signature(build) -> str:
    """The signature text of a build's parameter list (KernelDef.signature: the template's `params`)."""
    return render(build.params)
