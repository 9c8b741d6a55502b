"""The anchor's tables: every server's figures and the app's paired ratio to each llama-server."""

from __future__ import annotations

from benchmarks.llama.measure import ROWS
from benchmarks.stats import fmt


def compared(app: str, server: str) -> bool:
    """Which servers an app's speed is read against: the app on its defaults against every
    llama-server, with ``--quantize int4`` against llama.cpp's 4-bit files."""
    if not server.startswith("llama-server"):
        return False
    return "int4" not in app or "Q4" in server


def markdown(report: dict) -> str:
    m = report["machine"]
    ll = report["llama_cpp"]
    c = report["client"]
    lines = [f"# The app against llama.cpp's server, one run ({report['started']})", "",
             f"CPU: {m['cpus']} ({m['family_model']}; {m['cores']} cores), flags {' '.join(m['flags'])}. "
             f"Class: {m['cpu_class']}.",
             f"llama.cpp: {ll['version']}, built from {ll['from']} ({' '.join(ll['cmake'])}), served as "
             f"`llama-server -m X.gguf {ll['server_args']}`. The app: its defaults (`--model DIR`); "
             "`--quantize int4`: the same with the graph's 4-bit weights, read against llama.cpp's 4-bit files.",
             f"One client for all (`benchmarks.serve_bench.chat_stream`): distinct prompts, greedy, {c['max_tokens']} "
             f"tokens each; per round {c['one_stream_requests_per_round']} single streams (TTFT, decode), then "
             f"{' and '.join(map(str, c['streams']))} streams at once (aggregate), then one stream after a distinct "
             f"~{c['long_prompt_tokens']:,}-token document (CPython's pydoc topics, asked to be summarised); "
             f"{c['rounds']} rounds, the servers' "
             "order turned each round. Median (min–max). Ratios: the app's speed over that server's in the "
             "same round (the two measured back to back), median (min–max) over the rounds; above 1 the app "
             "is faster (TTFT: their time over the app's).", ""]
    for model in report["models"].values():
        names = list(model["summary"])
        app = model["summary"]["this app"]
        pairs = [(a, o) for a, over in model["app_over"].items() for o in over]
        lines += [f"## {model['title']}", "",
                  "| | " + " | ".join(names) + " | " + " | ".join(f"{short(a, 'app')} ÷ {short(o, '')}"
                                                                  for a, o in pairs) + " |",
                  "|---|" + "---|" * (len(names) + len(pairs))]
        for key, (label, digits) in ROWS.items():
            lines.append(f"| {label} | " + " | ".join(fmt(model["summary"][n][key], digits) for n in names) + " | "
                         + " | ".join(fmt(model["app_over"][a][o][key], 2) + "×" for a, o in pairs) + " |")
        served = " ".join(f"{'The app' if n == 'this app' else short(n, '')} served on: "
                          f"{'; '.join(filter(None, about['serving']))} ({about['workers']} worker(s), threads "
                          f"{about['threads']})." for n, about in model["servers"].items() if n.startswith("this app"))
        lines += ["", f"Prompt tokens per request {fmt(app['prompt_tokens'], 0)}, per long document "
                      f"{fmt(app['long_prompt_tokens'], 0)}; tokens per reply, all servers: "
                      + ", ".join(f"{n} {fmt(model['summary'][n]['tokens_per_reply'], 0)}" for n in names) + ".",
                  f"{served} The machine's load average "
                  f"(1 min) before and after: {model['load_average_before_after'][0]:.1f}, "
                  f"{model['load_average_before_after'][1]:.1f}. GGUF sizes: "
                  + ", ".join(f"{s['gguf']} {s['gguf_mb']} MB" for n, s in model["servers"].items() if "gguf" in s)
                  + ".", ""]
    return "\n".join(lines)


def short(name: str, empty: str) -> str:
    """A column's server without "this app" or "llama-server": ``empty`` where nothing is left."""
    return name.replace("this app", "").replace("llama-server", "").strip(" ,") or empty
