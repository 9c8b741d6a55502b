"""llama.cpp's own server beside this app, in one run: ``python -m benchmarks.llama_anchor``
(or ``python -m benchmarks.run --anchor llama``).

llama.cpp's ``llama-server`` is what users of this field run instead (Ollama runs it inside), so
it is the anchor the app's speed is read against. It is never a dependency of the app or its
tests: this module builds it for itself, once, into ``~/.cache/chat-bench/llama.cpp``:

- ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` from llama-cpp-python's source
  package (its sdist vendors llama.cpp under ``vendor/llama.cpp``), fetched with ``pip download
  --no-binary :all:``, built with cmake (``-DGGML_NATIVE=ON``: for this CPU), ~15-40 min on 2 shared cores;
- GGUF files of the checkpoints the benchmark serves: the Qwen1.5-0.5B shape
  (``benchmarks.qwen_shape``, random weights) and the bundled SmolLM2-135M (its converted
  safetensors), each converted with llama.cpp's own ``convert_hf_to_gguf.py`` to bf16, then
  quantized to q8_0 (as many bits as the app's int8) and Q4_K_M (Ollama's default); for the
  bundled model also the package's own GGUF file (Q4_1) as llama.cpp would load it.

Then, per model, the app (its defaults: the engine and kernels it measures) and one
``llama-server -t 2 -tb 2 -np 4 -c 8192`` per GGUF run side by side on 127.0.0.1, and the
same client (``benchmarks.serve_bench.chat_stream``) measures each in turn, alternating within
every round: time to first token and decode tok/s of one stream, aggregate tok/s of 2 and 4
streams, distinct ~70-token prompts, greedy, 64 tokens each; then one stream after a distinct
~1,500-token document (a window of CPython's ``pydoc_data`` topics, asked to be summarised): its
time to first token, and its decode, which reads the whole document's cache at every step.
With ``--int4`` the app runs a second time with ``--quantize int4``, its speed read against the
4-bit files (Q4_K_M, Q4_1).
Results go to ``benchmarks/results/<CPU class>/anchor.{md,json}``, every figure a median
(min–max) over the rounds, each row with the app's ratio to each llama-server in the same run.

Greedy decoding must not stop early on a stop token or print nothing: the same ``logit_bias``
goes to every server (OpenAI's field, which both take): for the bundled model, its stop tokens
banned; for the random-weight shape, +100 on 300 ordinary word tokens, so that every token has
text (ids past the bundled tokenizer's 49,152 would stream no text) and none stops the reply.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import qwen_shape, serve_bench
from benchmarks.stats import Summary, fmt
from tests.e2e import free_port, start_app

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp that is built
HOME = Path.home() / ".cache" / "chat-bench"
LLAMA = HOME / "llama.cpp"  # sdist/, llama_cpp_python-<v>/ (the source), build/bin/
GGUF = HOME / "gguf"
SERVER_ARGS = ("-t", "2", "-tb", "2", "-np", "4", "-c", "8192")
QUANTS = ("Q8_0", "Q4_K_M")
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")  # perplexity: benchmarks.int4_bench
MAX_TOKENS = 64
STREAMS = (2, 4)
ONE_STREAM_REQUESTS = 2  # per round: each gives a TTFT and a decode rate
LONG_PROMPT_TOKENS = 1500  # per round, one stream after a document this long (with the template and the ask)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")


# --- llama.cpp, built once -------------------------------------------------------------


def llama_source(home: Path = LLAMA) -> Path:
    """``vendor/llama.cpp`` of llama-cpp-python's sdist, downloaded and unpacked once."""
    src = home / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdists = home / "sdist"
    sdist = sdists / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        print(f"llama.cpp: pip download llama-cpp-python=={LLAMA_CPP_PYTHON} (source) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdists)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(home, filter="data")
    return src


def build_llama(home: Path = LLAMA) -> dict[str, Path]:
    """llama.cpp's tools the benchmarks use, built once (kept in ``home/build/bin``)."""
    bins = {name: home / "build" / "bin" / name for name in TOOLS}
    if all(path.is_file() for path in bins.values()):
        return bins
    src = llama_source(home)
    cmake = shutil.which("cmake") or str(Path(sys.executable).with_name("cmake"))
    if not Path(cmake).exists() and not shutil.which("cmake"):
        raise SystemExit("llama.cpp needs cmake: pip install cmake ninja (into this venv), or apt-get install cmake")
    if not (shutil.which("c++") or shutil.which("g++")):
        raise SystemExit("llama.cpp needs a C++ compiler: apt-get install g++")
    generator = ("-G", "Ninja") if shutil.which("ninja") or Path(sys.executable).with_name("ninja").exists() else ()
    print(f"llama.cpp: building {', '.join(TOOLS)} in {home / 'build'} (once; minutes) ...", flush=True)
    subprocess.run([cmake, "-S", str(src), "-B", str(home / "build"), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run([cmake, "--build", str(home / "build"), "-j", str(os.cpu_count() or 2),
                    "--target", *bins], check=True)
    return bins


def llama_commit(home: Path = LLAMA) -> str:
    """The llama.cpp build's own version line (``llama-server --version``)."""
    out = subprocess.run([str(home / "build" / "bin" / "llama-server"), "--version"], capture_output=True, text=True)
    return next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "unknown")


# --- GGUF files ----------------------------------------------------------------------


CONVERT = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
if pre:  # the shape's tokenizer is the bundled model's, saved again: its hash is unknown, its kind is not
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf_dir: str, out: Path, src: Path, pre_tokenizer: str = "") -> Path:
    """``hf_dir`` to a bf16 GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` (once), its BPE
    pre-tokenizer named (``pre_tokenizer``) where llama.cpp does not recognise the tokenizer."""
    if out.is_file():
        return out
    try:
        import sentencepiece  # noqa: F401 - the converter tries a SentencePiece vocabulary first
    except ImportError:
        raise SystemExit("convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    print(f"gguf: converting {hf_dir} -> {out.name} ...", flush=True)
    subprocess.run([sys.executable, "-c", CONVERT, str(src), pre_tokenizer, hf_dir, "--outfile", str(tmp),
                    "--outtype", "bf16"], check=True, cwd=src)
    tmp.rename(out)
    return out


def quantize(tool: Path, source: Path, kind: str) -> Path:
    """``source`` quantized to ``kind`` with ``llama-quantize`` (once)."""
    out = source.with_name(source.name.replace("-bf16.gguf", f"-{kind}.gguf"))
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        print(f"gguf: quantizing {source.name} -> {out.name} ...", flush=True)
        subprocess.run([str(tool), str(source), str(tmp), kind], check=True, capture_output=True)
        tmp.rename(out)
    return out


# --- the servers ---------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    stop: object  # () -> None
    about: dict  # what it serves, as it says


def start_llama(server: Path, gguf: Path, name: str, log: Path, timeout_s: float = 600) -> Server:
    port = free_port()
    process = subprocess.Popen([str(server), "-m", str(gguf), *SERVER_ARGS, "--host", "127.0.0.1",
                                "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return Server(name, url, stop, {"gguf": gguf.name, "args": " ".join(SERVER_ARGS),
                                                "gguf_mb": round(gguf.stat().st_size / 2**20)})
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop()
    raise TimeoutError(f"llama-server not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def start_this_app(tmp: Path, model: str, flags: tuple[str, ...] = ()) -> Server:
    """The app on its defaults and ``flags``, logging into its own folder of ``tmp``."""
    name = " ".join(("this app", *flags))
    (where := tmp / name.replace(" ", "_")).mkdir()
    app = start_app(where, "--model", model, "--log-level", "warning", *flags, ready_timeout_s=3600)
    health = app.health()
    about = {"engine": (health.get("engine") or {}).get("engine"),
             "serving": [w.get("kernels") for w in health["workers"]],
             "workers": len(health["workers"]), "threads": [w.get("threads") for w in health["workers"]]}
    return Server(name, app.url, app.stop, about)


# --- what every server is asked --------------------------------------------------------

SUBJECTS = ("a lighthouse keeper", "a baker in a mountain village", "a retired train driver", "a young beekeeper",
            "a ship's cook", "a night-shift nurse", "a clockmaker", "a shepherd", "a bus driver in the rain",
            "a gardener at an old castle", "a postwoman on an island", "a glassblower", "a violin teacher",
            "a fisherman's daughter", "a librarian at night", "a mapmaker", "a potter by a river",
            "a chess player on a train", "a forest ranger", "a street musician", "a beekeeper's grandson",
            "a weaver", "a night guard at a museum", "a snowplough driver", "a radio operator at sea",
            "a tea picker", "a bridge painter", "a shoemaker", "an old astronomer", "a ferry captain",
            "a farmer at harvest time", "a boy who repairs bicycles", "a woman who restores boats",
            "a cheese maker", "a mountain guide", "a baker's apprentice", "a crossing keeper", "a candle maker",
            "a kite maker", "a sailmaker", "a wool dyer", "an orchard keeper", "a window cleaner",
            "a stonemason", "a telescope builder", "a puppet maker", "a well digger", "a bell ringer")


def prompt(i: int) -> str:
    """The ``i``-th distinct prompt: ~70 tokens with the chat template's own (~25), and distinct from
    its first words on, so that no server reuses another request's prompt."""
    subject = SUBJECTS[i % len(SUBJECTS)]
    return (f"{subject.capitalize()} (story {i}): tell a long story about {subject}, over one whole day: "
            f"the morning light, the sounds and smells, the people met, what went wrong at noon, and the evening.")


def biases(tok, random_weights: bool) -> dict[str, float]:
    """The ``logit_bias`` every server is sent (see the module docstring); ``tok``: the model's tokenizer."""
    if not random_weights:
        stops = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
        return {str(t): -100.0 for t in sorted(stops) if t is not None and t >= 0}
    words = [i for i in range(1000, len(tok)) if (text := tok.decode([i])).startswith(" ") and text[1:].isalpha()]
    return {str(i): 100.0 for i in words[:300]}


def documents(tok) -> list[str]:
    """The long-context asks: consecutive windows of CPython's ``pydoc_data`` topics (text that
    ships with Python), each ~``LONG_PROMPT_TOKENS`` with the chat template, numbered from its
    first words on so that no server reuses another's prefix, each asked to be summarised."""
    from pydoc_data.topics import topics

    ids = tok("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]
    size = LONG_PROMPT_TOKENS - 50  # the template's tokens and the ask's
    return [f"Document {i}:\n\n{tok.decode(ids[start:start + size])}\n\nSummarise document {i} in a few sentences."
            for i, start in enumerate(range(0, len(ids) - size, size))]


@dataclass
class Asks:
    """What every server is sent for one model: the ``logit_bias`` (``biases``) and the long
    documents (``documents``); the short prompts are ``prompt``'s."""
    bias: dict[str, float]
    documents: list[str]

    @classmethod
    def of(cls, model_dir: str, random_weights: bool) -> Asks:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        return cls(biases(tok, random_weights), documents(tok))

    def body(self, content: str) -> dict:
        return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "logit_bias": self.bias}


def measure_round(server: Server, asks: Asks, first_prompt: int) -> dict:
    """One round on one server: one stream ``ONE_STREAM_REQUESTS`` times, then 2 and 4 at once,
    then one stream after a long document."""
    out: dict = {"ttft_ms": [], "decode_tok_s": [], "prompt_tokens": [], "tokens": []}
    n = first_prompt
    for _ in range(ONE_STREAM_REQUESTS):
        r = serve_bench.chat_stream(server.url, asks.body(prompt(n)))
        n += 1
        out["ttft_ms"].append(r["ttft_ms"])
        out["decode_tok_s"].append(r["decode_tok_s"])
        out["prompt_tokens"].append(r["prompt_tokens"])
        out["tokens"].append(r["tokens"])
    for streams in STREAMS:
        r = serve_bench.concurrent_streams(server.url, [asks.body(prompt(n + k)) for k in range(streams)])
        n += streams
        out[f"aggregate_{streams}_tok_s"] = r["aggregate_tok_s"]
        out["tokens"] += [s["tokens"] for s in r["streams"]]
    r = serve_bench.chat_stream(server.url, asks.body(asks.documents[n % len(asks.documents)]))
    out.update(long_ttft_ms=r["ttft_ms"], long_decode_tok_s=r["decode_tok_s"], long_prompt_tokens=r["prompt_tokens"])
    out["tokens"].append(r["tokens"])
    return out


def measure_group(servers: list[Server], asks: Asks, rounds: int, first_prompt: int) -> dict[str, list[dict]]:
    """Every server measured in every round, the order turned by one each round (alternating)."""
    per_round = ONE_STREAM_REQUESTS + sum(STREAMS) + 1
    for s in servers:  # warm-up: lazy init, first graph runs
        serve_bench.chat_stream(s.url, {**asks.body(prompt(first_prompt)), "max_tokens": 8})
    results: dict[str, list[dict]] = {s.name: [] for s in servers}
    n = first_prompt + 1
    for r in range(rounds):
        order = servers[r % len(servers):] + servers[: r % len(servers)]
        for s in order:
            print(f"  round {r + 1}/{rounds}: {s.name} ...", flush=True)
            results[s.name].append(measure_round(s, asks, n))
            n += per_round
    return results


ROWS = {  # what is measured → its row in the tables (here and ``benchmarks.serve_ab``), digits shown
    "ttft_ms": ("time to first token, ms", 0), "decode_tok_s": ("decode, 1 stream, tok/s", 1),
    **{f"aggregate_{n}_tok_s": (f"aggregate, {n} streams, tok/s", 1) for n in STREAMS},
    "long_ttft_ms": (f"after a ~{LONG_PROMPT_TOKENS:,}-token document: time to first token, ms", 0),
    "long_decode_tok_s": (f"after a ~{LONG_PROMPT_TOKENS:,}-token document: decode, tok/s", 1)}
SPEEDS = tuple(ROWS)


def summarize(runs: list[dict]) -> dict:
    flat = lambda key: [v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]])]  # noqa: E731
    return {**{key: Summary.of(flat(key)).dict() for key in (*SPEEDS, "prompt_tokens", "long_prompt_tokens")},
            "tokens_per_reply": Summary.of(flat("tokens")).dict()}


def paired_ratio(app_runs: list[dict], other_runs: list[dict], key: str) -> dict:
    """The app's speed over the other server's, round by round (the two measured back to back, so
    a slower spell of a shared machine falls on both), as median (min–max) over the rounds: above
    1, the app is faster (TTFT: the other's time over the app's)."""
    def per_round(run: dict) -> float:
        v = run[key]
        return statistics.median(v) if isinstance(v, list) else v
    return Summary.paired([per_round(a) for a in app_runs], [per_round(o) for o in other_runs],
                          higher_is_better=not key.endswith("ttft_ms")).dict()


# --- the run -------------------------------------------------------------------------


def compared(app: str, server: str) -> bool:
    """Which servers an app's speed is read against: the app on its defaults against every
    llama-server, with ``--quantize int4`` against llama.cpp's 4-bit files."""
    if not server.startswith("llama-server"):
        return False
    return "int4" not in app or "Q4" in server


def cpu_family_model() -> str:
    """``family F, model M`` as lscpu prints them (the CPU's name alone says "AMD EPYC" for several)."""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in
                                                Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)}
    return f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run import CACHE, _machine, save
    from workers.loading.resolve import bundled_gguf, resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="qwen-shape,bundled", help="comma-separated: qwen-shape, bundled")
    p.add_argument("--int4", action="store_true", help="also the app with --quantize int4, read against "
                   "llama.cpp's 4-bit files")
    args = p.parse_args(argv)
    apps = [(), ("--quantize", "int4")] if args.int4 else [()]
    machine = {**_machine(), "family_model": cpu_family_model()}
    tools = build_llama()
    src = llama_source()
    bundled = resolve_model("bundled", CACHE)
    qwen = str(qwen_shape.build(CACHE / "qwen1.5-0.5b-shape", bundled.path))
    models = {
        "qwen-shape": {"title": "Qwen1.5-0.5B shape (random weights)", "dir": qwen, "random": True,
                       "gguf": {}},
        "bundled": {"title": "bundled SmolLM2-135M-Instruct", "dir": bundled.path, "random": False,
                    "gguf": {"its own GGUF (Q4_1)": bundled_gguf()}},
    }
    report: dict = {"machine": machine, "started": time.ctime(), "llama_cpp": {
        "from": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp", "version": llama_commit(),
        "cmake": list(CMAKE_FLAGS), "server_args": " ".join(SERVER_ARGS)},
        "client": {"max_tokens": MAX_TOKENS, "greedy": True, "rounds": args.rounds,
                   "one_stream_requests_per_round": ONE_STREAM_REQUESTS, "streams": list(STREAMS),
                   "long_prompt_tokens": LONG_PROMPT_TOKENS},
        "models": {}}
    first_prompt = 0
    for key in args.models.split(","):
        model = models[key]
        bf16 = convert(model["dir"], GGUF / f"{key}-bf16.gguf", src, "smollm" if model["random"] else "")
        ggufs = {f"llama-server {kind.lower() if kind == 'Q8_0' else kind}": quantize(tools["llama-quantize"], bf16, kind)
                 for kind in QUANTS}
        ggufs.update({f"llama-server, {name}": path for name, path in model["gguf"].items()})
        asks = Asks.of(model["dir"], model["random"])
        print(f"anchor: {model['title']}: the app and {len(ggufs)} llama-server(s) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            servers = []
            for flags in apps:
                servers.append(start_this_app(Path(tmp), model["dir"], flags))
                stack.callback(servers[-1].stop)
            for name, gguf in ggufs.items():
                servers.append(start_llama(tools["llama-server"], gguf, name, Path(tmp) / f"{gguf.stem}.log"))
                stack.callback(servers[-1].stop)
            load = [os.getloadavg()[0]]
            raw = measure_group(servers, asks, args.rounds, first_prompt)
            load.append(os.getloadavg()[0])
        first_prompt += 1000
        summary = {name: summarize(runs) for name, runs in raw.items()}
        ratios = {app.name: {name: {k: paired_ratio(raw[app.name], runs, k) for k in SPEEDS}
                             for name, runs in raw.items() if compared(app.name, name)}
                  for app in servers[: len(apps)]}
        report["models"][key] = {"title": model["title"], "servers": {s.name: s.about for s in servers},
                                 "load_average_before_after": load,
                                 "raw": raw, "summary": summary, "app_over": ratios}
    save(machine, "anchor", report, markdown(report))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
