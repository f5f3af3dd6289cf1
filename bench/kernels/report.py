"""The kernel benchmarks' report: a header, a table per section, and the targets met or
missed, from the figures `bench.kernels.run` returns."""
from __future__ import annotations

#: the kernel cases, in the order they run and are reported
SECTIONS = ("write", "clone", "decode", "grouped", "skewed", "prefill", "mixed")


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def _count(n: int, noun: str) -> str:
    """`n noun`, the noun plural unless n is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def report_header(result) -> str:
    """The device, shapes, peers and roofline the tables are measured against."""
    s = result["sizes"]
    c = result["copy"]
    others = ", ".join(d for d in s["dtypes"] if d != s["dtype"])
    also = f"; attention also in {others}" if others else ""
    device = result["device"]
    where = f"the {device}" if device == "simulator" else device
    return (f"kernels on {where} ({s['dtype']} storage{also}; "
            f"{_count(s['n_kv_heads'], 'kv head')}, "
            f"{_count(s['n_q_heads'], 'q head')}, head_dim "
            f"{s['head_dim']}; PyTorch with CUDA: {result['torch'] or 'none, no peers'})\n"
            f"  roofline: d2d copy of {c['bytes'] >> 20} MiB = "
            f"{_f(c['traffic_gbps'], '.0f')} GB/s read+write; fp16 torch.matmul "
            f"{_f(result['matmul_tflops'], '.0f')} TFLOP/s\n"
            f"  GPU µs: CUDA events around back-to-back calls (median); host µs: time for "
            f"the call to return")


#: per section: (title, field, width, format, scale); format None: the text as it is
_TIMES = [("GPU µs", "ms", 9, ".1f", 1e3), ("host µs", "host_us", 8, ".1f", 1)]
_DTYPE = ("dtype", "dtype", 9, None, 1)
_OF_COPY = ("of copy", "of_copy", 8, ".0%", 1)
_FLASH = [("x flash", "vs_flash", 8, ".2f", 1), ("max|d|", "max_abs_diff", 8, ".1e", 1)]
_COLUMNS = {
    "write": [("case", "case", 30, None, 1), ("MiB", "bytes", 7, ".1f", 2 ** -20), *_TIMES,
              _OF_COPY],
    "decode": [("case", "case", 24, None, 1), _DTYPE, *_TIMES,
               ("wall µs", "wall_us", 8, ".1f", 1), _OF_COPY,
               ("x sdpa", "vs_sdpa", 7, ".2f", 1), ("x loop", "vs_sdpa_loop", 7, ".2f", 1),
               *_FLASH],
    "prefill": [("case", "case", 12, None, 1), _DTYPE, *_TIMES,
                ("TFLOP/s", "tflops", 8, ".1f", 1), ("of mm", "of_matmul", 7, ".0%", 1),
                *_FLASH],
    "mixed": [("case", "case", 40, None, 1), ("mixed µs", "mixed", 9, ".1f", 1e3),
              ("prefill µs", "prefill alone", 10, ".1f", 1e3),
              ("decode µs", "decode alone", 10, ".1f", 1e3), ("x parts", "vs_parts", 8, ".2f", 1)],
}
_COLUMNS["clone"] = _COLUMNS["write"]
_COLUMNS["grouped"] = [("case", "case", 24, None, 1), ("dtype", "dtype", 11, None, 1), *_TIMES,
                       _OF_COPY]
_COLUMNS["skewed"] = _COLUMNS["decode"]
_TITLES = {
    "write": "write: read+write traffic as a fraction of the roofline",
    "clone": "clone: read+write traffic as a fraction of the roofline",
    "decode": "decode attention: K/V bytes read as a fraction of the roofline; x peer = "
              "peer time / kvnumba time",
    "grouped": "decode attention of grouped queries (tensor cores): K/V bytes read as a "
               "fraction of the roofline",
    "skewed": "decode attention, skewed batch (geomspace lengths)",
    "prefill": "prefill attention (causal): TFLOP/s, fraction of the fp16 matmul rate",
    "mixed": "mixed step vs its prefill part alone + its decode part alone",
}


def _cell(value, width, fmt, scale) -> str:
    if fmt is None:
        return format(str(value), f"<{width}")
    return format("-" if value is None else format(value * scale, fmt), f">{width}")


def report_section(result, key) -> str:
    """The table of section `key`: its title, column heads and a line per row."""
    columns = _COLUMNS[key]
    header = " ".join(format(title, f"<{w}" if fmt is None else f">{w}")
                      for title, _, w, fmt, _ in columns)
    lines = [_TITLES[key], "  " + header]
    for row in result.get(key, []):
        if "error" in row:
            lines.append(f"  {row.get('case', key)} ERROR {row['error']}")
            continue
        lines.append("  " + " ".join(_cell(row.get(field), w, fmt, scale)
                                     for _, field, w, fmt, scale in columns))
    return "\n".join(lines)


def report_targets(result) -> str:
    """Each target (set for float16): the figure it is judged on, and met / missed."""
    t = result["targets"]
    rows = {r.get("case"): r for key in ("decode", "skewed", "prefill")
            for r in result.get(key, []) if r.get("dtype") == "float16"}
    checks = []

    def check(name, value, target, higher=True):
        if value is None:
            checks.append(f"  {name}: not measured")
            return
        ok = value >= target if higher else value <= target
        checks.append(f"  {name}: {value:.3g} (target {'>=' if higher else '<='} {target:g}: "
                      f"{'met' if ok else 'MISSED'})")

    big = rows.get("128 x 4096", {})
    check("decode 128 x 4096, fraction of roofline", big.get("of_copy"), t["decode_of_copy"])
    check("decode 128 x 4096, x sdpa", big.get("vs_sdpa"), t["decode_vs_sdpa"])
    skewed = next((r for k, r in rows.items() if k and k.startswith("skewed") and "flat" in k), {})
    check("skewed flat, fraction of roofline", skewed.get("of_copy"), t["decode_of_copy"])
    check("skewed flat, x flash varlen", skewed.get("vs_flash"), t["skewed_vs_flash"])
    write = result.get("write", [{}])[0]
    check("write prefill, fraction of roofline", write.get("of_copy"), t["write_of_copy"])
    clone = result.get("clone", [{}])[0]
    check("clone, fraction of roofline", clone.get("of_copy"), t["clone_of_copy"])
    single = rows.get("1 x 512", {})
    check("decode 1 x 512, wall µs", single.get("wall_us"), t["single_decode_wall_us"],
          higher=False)
    for name in ("4x1024", "4x512@4096"):
        check(f"prefill {name}, TFLOP/s", rows.get(name, {}).get("tflops"), t["prefill_tflops"])
        check(f"prefill {name}, x flash varlen", rows.get(name, {}).get("vs_flash"),
              t["prefill_vs_flash"])
    mixed = result.get("mixed", [{}])[0]
    check("mixed step, (prefill + decode) / mixed", mixed.get("vs_parts"), 1.0)
    return "targets (H200-class GPU, float16):\n" + "\n".join(checks)


def report(result) -> str:
    """The whole report, or why the kernels were not benchmarked."""
    if result.get("skipped"):
        return result["reason"]
    return "\n".join([report_header(result)] + [report_section(result, k) for k in SECTIONS]
                     + [report_targets(result)])
