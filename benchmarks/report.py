"""The report of one run: the text the suite prints, the markdown page
(``docs/performance.md``, with its method), the cold-vs-depth plot, and the machine
they describe. The goals are in ``report_goals.py``, the tables in ``report_tables.py``,
the real-size run's section in ``report_real_size.py``.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from report_goals import constructor_run, goals, layers_of
from report_tables import (
    cold_tables,
    host_table,
    md_table,
    planning_table,
    recipe_label,
    restart_table,
    warm_tables,
)


def machine() -> dict[str, Any]:
    """The machine and the versions; starts no jax backend."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "flax": version("flax"),
        "meshinit": commit or version("meshinit"),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
    }


# The GPU section of docs/performance.md: what `python benchmarks/gpu.py` printed on the
# last GPU machine lent to a session (the CPU suite cannot measure it); replace it with
# the next GPU run's table.
GPU = """\
`python benchmarks/gpu.py`: Llama-3-8B shapes in bf16 (16.06 GB of parameters) on one
NVIDIA H200 (jax 0.11.2, jaxlib 0.11.2, flax 0.12.10; mesh (fsdp=1, tensor=1)), in one
process, persistent compilation cache off; meshinit at the commit of the layout moves
(issue 40), 2026-12-04. Two runs on the same machine, minutes apart (`--repeats 3`, then
`--repeats 5`), to show the noise:

| case | run 1 | run 2 | XLA compile (run 1, summed over threads) |
|---|---|---|---|
| meshinit cold (specs + plan + materialize) | 1.072 s | 1.094 s | 2.09 s (3 compiles) |
| `meshinit.nnx.init` cold (unchanged nnx Module) | 2.003 s | 2.055 s | 2.30 s (3 compiles) |
| `jax.jit` fused cold (compile + run) | 58.355 s | 44.783 s | 57.89 s (1 compile) |
| meshinit warm re-init (new key), best | 0.050 s | 0.049 s | none |
| `jax.jit` fused warm re-init (new key), best | 0.114 s | 0.114 s | none |

| ratio | run 1 | run 2 | goal |  |
|---|---|---|---|---|
| cold: meshinit / `jax.jit` | 0.018 | 0.024 | meshinit cold <= 3 s | met (1.07 s, 1.09 s) |
| cold: `meshinit.nnx.init` / `jax.jit` | 0.034 | 0.046 |  |  |
| warm throughput: `jax.jit` time / meshinit time | 2.270 | 2.308 | >= 0.8 | met |

On GPU meshinit keeps XLA's default compiler options; its warm re-init writes 16 GB in
50 ms (about 320 GB/s of parameters), the fused executable in 114 ms.
`python benchmarks/gpu.py --cpu-check` runs the same code on 8 simulated CPU devices
with a tiny model, and the test suite runs it (slow tier)."""


# The TPU section of docs/performance.md: what `python benchmarks/tpu.py` printed on the
# last TPU machine lent to a session, in two device calls (a device call runs at most 10
# minutes); replace it with the next TPU run's tables.
TPU = """\
`python benchmarks/tpu.py`: the 16-layer Llama-3-8B-shaped stack in bf16 (9.08 GB) on
one TPU v5e chip (jax 0.10.2, jaxlib 0.10.2, flax 0.12.8, Python 3.11; mesh (fsdp=1,
tensor=1)), each row a fresh process, meshinit with tiled programs (issue 51),
2026-12-06. Two device calls: `--parts cold`, then `--parts restart bits load
--bits-layers 0 --bits-dtypes float32 --load-mib 1024 --repeats 2`.

| 16 layers, 9.08 GB | cold | / jitted | compile, all threads | compiles | slowest | warm re-init |
|---|---|---|---|---|---|---|
| meshinit spec path | 2.20 s | 0.037x | 9.94 s | 8 | 1.65 s | 0.216 s |
| `meshinit.nnx.init` | 2.40 s | 0.043x | 9.51 s | 8 | 1.71 s |  |
| `meshinit.linen.init` | 2.72 s | 0.040x | 12.09 s | 8 | 2.04 s |  |
| `jax.jit(out_shardings=...)`, fused | 59.92 s |  | 58.18 s | 1 | 58.18 s | 0.293 s |
| `nnx.jit` | 55.21 s |  | 53.70 s | 1 | 53.70 s |  |
| `jax.jit(model.init, out_shardings=...)`, linen | 67.44 s |  | 66.43 s | 1 | 66.43 s |  |
| eager nnx | 37.29 s | 0.675x | 35.94 s | 27 | 12.39 s |  |

/ jitted: the spec path against the fused `jax.jit`, `meshinit.nnx.init` and eager nnx
against `nnx.jit`, `meshinit.linen.init` against linen's `jax.jit`. Every placement was
exact. Before tiles (issue 51's own run, the same chip and model) meshinit's three rows
were 14.2, 14.3 and 15.9 s cold, 0.24x the jitted recipes, its slowest program 14.3 s
(the embedding and the head) and its warm re-init 0.150 s.

| restart with jax's persistent cache, a fresh process | cold | compiles | reading the cache |
|---|---|---|---|
| meshinit spec path | 0.79 s | 0 | 0.77 s |
| `meshinit.nnx.init` | 0.92 s | 0 | 0.72 s |
| `meshinit.linen.init` | 0.91 s | 0 | 0.77 s |

(jax's cache in a temporary folder, its own thresholds left as they are: meshinit writes
its programs whatever their compile time; one process filled it first.)

| values: the embedding and the head (1.05 G elements, f32) | differ | max ulp |
|---|---|---|
| `meshinit.nnx.init` vs `nnx.jit` | 0 | 0 |
| `meshinit.linen.init` vs `jax.jit(model.init, out_shardings=...)` | 0 | 0 |
| `meshinit.nnx.init` vs eager nnx | 711,820,960 (67.7%) | 2085 |

| 1 GiB of bf16 safetensors into HBM (page cache warm) | best of 2 | / `device_put` |
|---|---|---|
| `meshinit.safetensors.load` | 0.134 s | 0.868x |
| `jax.device_put` of each memory-mapped tensor | 0.154 s | 1.000x |
| `safe_open` (numpy), then `jax.device_put` | 1.492 s | 9.658x |
| orbax v1's safetensors layout | 3.207 s | 20.763x |

Goals (issue 51): cold <= 3 s and <= 0.05x the jitted recipes: met by all three; the
slowest program <= 2 s: 1.65 s and 1.71 s, 2.04 s for linen in the table's run; warm
re-init <= 0.15 s: 0.216 s (not met: a tiled program runs a loop, 1.3x a whole array's
time in bf16; still 0.74x the fused `jax.jit`'s re-init); a restart <= 1 s with no
compile: met; the load <= 0.8x `device_put`: 0.868x (not met in this run; the load path
did not change, and issue 51's own run measured 0.78x at 2 GiB).

| `--parts depth` | slowest, 4 layers | slowest, 16 | cold, 4 layers | cold, 16 |
|---|---|---|---|---|
| meshinit spec path | 1.72 s | 1.79 s | 2.12 s | 2.32 s |
| `meshinit.nnx.init` | 1.71 s | 1.79 s | 2.15 s | 2.50 s |
| `meshinit.linen.init` | 1.84 s | 1.84 s | 2.29 s | 2.55 s |

(A later session, 2026-12-06, the same chip and stack: 8 programs in each row, each
recipe a fresh process, `--depth-layers 4`, then 16; the slowest program is the same at
both depths, one per tiled signature and the rest bucketed. Linen's 2.04 s in the
table's run was 1.84 s here: met at both depths.)
Tile sizes and their measurements: benchmarks/README.md, "Tiles".
`python benchmarks/tpu.py --cpu-check` runs every part on 8 simulated CPU devices with
a tiny model, and the test suite runs it (slow tier)."""


def _sections(results: dict) -> list[tuple[str, str]]:
    return [
        ("Goals", md_table(["measure", "value", "goal", ""], goals(results))),
        ("Cold init vs depth", cold_tables(results)),
        ("Warm re-init and per-device memory", warm_tables(results)),
        ("Host memory", host_table(results)),
        ("Restarts", restart_table(results)),
        ("Planning", planning_table(results)),
        ("GPU", "" if constructor_run(results) else GPU),
        ("TPU", "" if constructor_run(results) else TPU),
    ]


def notes(results: dict) -> list[str]:
    """Anything unexpected in this run, as measured."""
    found = []
    for recipe, by_layers in results["cold"].items():
        for n, r in by_layers.items():
            if "error" in r:
                found.append(f"`{recipe}` at {n} layers failed: {r['error']}")
            elif r["problems"]:
                found.append(f"`{recipe}` at {n} layers is not placed exactly: {r['problems']}")
            if r.get("errors") and "error" not in r:
                found.append(
                    f"`{recipe}` at {n} layers: {len(r['errors'])} of {len(r['runs'])} "
                    f"processes failed: {r['errors'][0]}"
                )
    for name, w in results.get("warm", {}).get("meshinit", {}).items():
        if w["compiles"]:
            found.append(f"{recipe_label(name, {'': w})} compiled {w['compiles']} times on re-init")
    return found


def text(results: dict) -> str:
    m = results["machine"]
    out = [
        f"{m['platform']}, {m['cpu_count']} CPUs ({m['cpu']}), jax {m['jax']}, "
        f"flax {m['flax']}, meshinit {m['meshinit']}, load {m['load_avg'][0]:.2f}"
    ]
    if results["config"].get("smoke"):
        out.append("--smoke: tiny sizes; the goals are meant for the full suite's sizes")
    out += [f"\n## {title}\n\n{body}" for title, body in _sections(results) if body]
    out += [f"note: {n}" for n in notes(results)]
    return "\n".join(out)


METHOD = """\
The CPU reference model is a Llama-style stack in f32: `embed` (4096, 256), per layer
`q` (256, 256), `k` and `v` (256, 64), `o` (256, 256), `gate` and `up` (256, 1024),
`down` (1024, 256) (all lecun_normal), the norms `n1`, `n2` (256,) (ones), and `head`
(256, 4096). It is placed on a (fsdp=2, tensor=4) mesh of 8 simulated CPU devices
(`jax_num_cpu_devices=8`) with the rules `vocab, heads, kv, mlp -> tensor` and
`embed -> fsdp`.

Recipes, all producing the same tree of arrays:

- `meshinit`: build the specs, `meshinit.plan`, `meshinit.materialize` (the default
  strategy); `meshinit:<name>` selects another strategy with
  `meshinit.options(strategy=<name>)`, and `meshinit+xla-defaults` is the default
  strategy compiled with XLA's default options instead of meshinit's CPU compiler
  options (`meshinit.options(compiler_options={})`): it measures what that choice
  trades between cold and warm time.
- `nnx.jit`: a flax nnx Module whose `__init__` makes each parameter as
  `nnx.Param(init(rngs.params(), shape), out_sharding=<mesh axes>, mesh=mesh)`,
  constructed inside `nnx.jit` under `jax.set_mesh(mesh)`.
- `jax.jit`: MaxText's recipe, one `jax.jit(build, out_shardings=...)` with every
  parameter as an output.
- `eager-nnx`: the same Module constructed eagerly; flax's eager sharding (on by
  default) places each array.

Unchanged constructors (meshinit's constructor engine), the same stack written as
ordinary framework code, against the framework's own sharded-init recipe:

- `meshinit.nnx`: `meshinit.nnx.init(lambda: Transformer(nnx.Rngs(0)))` of the
  `nnx.jit` recipe's Module, unchanged.
- `meshinit.nnx:2mesh`: the same with `meshes=`, split over two disjoint
  (fsdp=2, tensor=2) stage meshes: `embed` and the first half of the layers on
  devices 0-3, the rest and `head` on devices 4-7; each array is checked against its
  stage's mesh.
- `meshinit.nnx:table`: the same Module without sharding metadata (`nnx.Param(init(...))`),
  placed by a table kept outside it: `meshinit.nnx.init(..., placements=table,
  mesh=mesh)`, one `(regex, PartitionSpec)` entry per parameter name
  (`layers\\.\\d+\\.q`, ...). `meshinit.linen:table` is the linen Module without its
  `nn.with_logical_partitioning` boxes, placed by the same table in logical names
  (`rules=rules`). The goal: the same speed as the annotated model.
- `linen.jit`: a linen Module whose params are `self.param(name,
  nn.with_logical_partitioning(init, axes), shape, dtype)`, initialized by flax's
  recipe: `jax.eval_shape(module.init, ...)`, `nn.get_partition_spec`,
  `nn.logical_to_mesh_sharding(..., mesh, rules)`, then `jax.jit(module.init,
  out_shardings=...)`. It runs without a mesh context: on the reference mesh's
  Explicit axes, the boxes' `with_sharding_constraint` would be an assertion.
- `meshinit.linen`: `meshinit.linen.init(module, key, tokens, mesh=mesh,
  rules=rules)` of that Module; `meshinit.linen:2mesh` adds `meshes=` with the
  two-stage split.
- `eqx.filter_jit`: an equinox stack (`eqx.nn.Embedding`, `eqx.nn.Linear` without
  bias, whose weights are (out, in), ones for the norms) built by
  `eqx.filter_jit` of its constructor, every array placed inside: `eqx.filter_shard`
  on Auto axes, `jax.sharding.reshard` on Explicit ones (jax rejects
  `with_sharding_constraint`, which `filter_shard` is, there).
- `meshinit.eqx`: `meshinit.eqx.init(factory, key, placements, mesh=mesh,
  rules=rules)` of that constructor, with one regex per parameter name.

Cold cases: each in a fresh process, persistent compilation cache off; the clock starts
after imports and mesh creation and stops when `jax.block_until_ready` returns on every
array; it includes building specs, plan and module. The best of the processes is
shown. After the clock stops, every array's mesh, PartitionSpec and shards are checked
against the exact expected placement (resolved without meshinit). Compile time is the
sum of `/jax/core/compile/backend_compile_duration` events (a `jax.monitoring`
listener) in that process; meshinit compiles its executables in parallel threads (one
per core), so its sum can exceed the time the compiles took.

Warm re-init: in one process, meshinit's `materialize` of the same plan with a new
key, against the fused jit recipe's already compiled executable called with a new key
(keys made beforehand). The calls are interleaved, one of each recipe per new key, so
a change in the machine's load hits all of them alike; each gets the best of its
calls, and the median is shown too. The throughput ratio is fused time / meshinit
time. A second fused jit is built the way meshinit builds its CPU programs: traced
with meshinit's straight-line threefry hash (jax's threefry2x32 bits, without jax's
rolled CPU loop) and compiled with meshinit's CPU compiler options (XLA backend
optimization level 1, classic emitters), and timed the same way. It runs meshinit's
kernels in one launch, so meshinit's time against it is what meshinit's launches
cost, and its time against the first is what the hash and the options change.

Per-device memory: `memory_analysis()` of meshinit's compiled executables (per device,
SPMD). Replaying meshinit's run order, each call's peak is the parameters made so far
plus that call's outputs and temporaries; the goal compares the largest such peak with
the device's share of all parameters. (meshinit runs the calls that make the most
bytes first, so any temporaries come while little else is allocated.) The fused jit
recipe's single executable is shown for comparison.

Host memory: a cold init of the reference stack made wider, in a fresh process; the
peak RSS high-water mark is reset right before the clock starts
(`/proc/self/clear_refs`), and the increase is the peak (`VmHWM`) minus the RSS at the
start. All 8 simulated devices share the host's memory.

Planning: `meshinit.plan` of a tree of specs, the first call in a fresh process (which
includes one abstract evaluation per distinct initializer and shape), and the best of
three more calls. Building the specs is timed separately."""


def markdown(results: dict, png: str | None) -> str:
    m, cfg = results["machine"], results["config"]
    lines = [
        "# Performance",
        "",
        "Measured by `benchmarks/suite.py`; every number below comes from one run:",
        "",
        "```",
        results["command"],
        "```",
        "",
        f"- Machine: {m['platform']}, {m['cpu_count']} CPUs ({m['cpu']}); load average "
        f"{m['load_avg'][0]:.2f} at the start (a shared machine: expect noise).",
        f"- Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, "
        f"meshinit at `{m['meshinit']}`; {m['date']}; the suite took "
        f"{results['wall_s'] / 60:.1f} min.",
        f"- Cold cases: best of {cfg['repeats']} processes; width x{cfg['width']}. "
        + (
            "Only the constructor engine's cases ran."
            if constructor_run(results)
            else f"Warm: {cfg['warm_layers']} layers, best of {cfg['warm_repeats']} calls. "
            f"Host memory: {cfg['mem_layers']} layers, width x{cfg['mem_width']}."
        ),
        "",
        "## Method",
        "",
        METHOD,
    ]
    for title, body in _sections(results):
        if body:
            lines += ["", f"## {title}", "", body]
        if title == "Cold init vs depth" and png:
            lines += ["", f"![cold init time vs depth]({png})"]
    found = notes(results)
    if found:
        lines += ["", "## Notes from this run", ""] + [f"- {n}" for n in found]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> str:
    """Writes the cold-time-vs-depth plot; returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for recipe, by_layers in results["cold"].items():
        points = sorted((int(n), r["seconds"]) for n, r in by_layers.items() if "seconds" in r)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=recipe_label(recipe, by_layers))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize="x-small")
    layers = layers_of(results)
    ax.set_xticks(layers, [str(n) for n in layers])
    ax.set_xlabel("layers")
    ax.set_ylabel("cold init time (s), best of processes")
    ax.set_title("Cold init on 8 simulated CPU devices")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
