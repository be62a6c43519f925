"""jkv.sharding on one device: mesh specs, their errors, the logical-axis rules; and the sharded suite
(tests/test_sharding_devices.py) run in a process of its own with 4 forced CPU devices."""

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jkv import cli, sharding
from jkv.cache import CacheMethod, CacheSpec
from jkv.config import ModelConfig
from jkv.memory import largest_batch
from jkv.methods import make_method

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig("llama", vocab_size=128, embed=96, ffw_size=160, num_layers=2, q_heads=6, kv_heads=2, head_dim=64,
                  max_position=2048)


def abstract_mesh(data, model):
  """A mesh of any shape without its devices (rules and checks read only the axis sizes)."""
  try:
    return AbstractMesh((data, model), sharding.MESH_AXES)
  except TypeError:  # older signature: ((name, size), ...)
    return AbstractMesh((("data", data), ("model", model)))


def test_mesh_spec_parses_with_missing_axes_of_size_one():
  assert sharding.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
  assert sharding.parse_mesh(" model=2 ") == {"data": 1, "model": 2}


@pytest.mark.parametrize("text, message", [
    ("gpu=2", "unknown axis 'gpu'; the axes are data, model"),
    ("data=2,data=2", "axis 'data' is given twice"),
    ("data=two", "size of 'data' must be an integer, got 'two'"),
    ("model=0", "size of 'model' must be >= 1, got 0"),
    ("data:2", "expected axis=size, got 'data:2'"),
    ("", "empty mesh spec"),
])
def test_bad_mesh_specs_are_one_line_errors(text, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
    sharding.parse_mesh(text)
  assert "\n" not in str(e.value)


def test_mesh_must_match_the_device_count():
  one = jax.devices()[:1]
  with pytest.raises(ValueError, match=r"mesh data=2,model=4 needs 8 devices \(data x model\), but 1 \w+ device is "
                                       "visible"):
    sharding.make_mesh("data=2,model=4", devices=one)
  assert sharding.make_mesh("data=1", devices=one).shape == {"data": 1, "model": 1}
  assert sharding.make_mesh(None) is None


@pytest.mark.parametrize("data, model, batch, message", [
    (1, 4, 4, r"the model's 2 KV heads \(6 query heads\) do not split over model=4"),
    (2, 1, 3, "a batch of 3 sequences does not split over data=2"),
])
def test_mesh_must_split_the_heads_and_the_batch(data, model, batch, message):
  with pytest.raises(ValueError, match=message):
    sharding.check_mesh(abstract_mesh(data, model), CFG, batch)


def test_logical_axes_map_to_mesh_axes():
  mesh = abstract_mesh(2, 4)
  assert sharding.logical_to_spec(("layers", "batch", "kv_heads", "tokens", "head_dim"), mesh) == P(None, "data",
                                                                                                      "model")
  assert sharding.logical_to_spec(("layers", "batch"), mesh) == P(None, "data")
  assert sharding.logical_to_spec(("vocab", "embed"), mesh, shape=(50, 8), strict=False) == P()  # 50 % 4: whole
  with pytest.raises(ValueError, match="'q_heads' and 'kv_heads' both map to mesh axis 'model'"):
    sharding.logical_to_spec(("q_heads", "kv_heads"), mesh)
  with pytest.raises(ValueError, match="axis 'kv_heads' of size 2 does not split over model=4"):
    sharding.logical_to_spec(("batch", "kv_heads"), mesh, shape=(2, 2))


def test_parameters_split_over_heads_and_the_mlp():
  axes = sharding.param_axes(CFG)
  spec = lambda a: sharding.logical_to_spec(a, abstract_mesh(2, 2))
  assert spec(axes.layers.qkv) == P(None, None, "model") and spec(axes.layers.o) == P(None, "model")
  assert spec(axes.layers.gate_up) == P(None, None, None, "model") and spec(axes.layers.w_down) == P(None, "model")
  assert spec(axes.layers.attn_norm) == P()


def test_per_shard_forwards_every_cache_call():
  """A cache call PerShard does not define would run the interface's default on the sharded state (a no-op
  end_step left SpeCache's host copy unwritten on a mesh): every call of the interface is its own."""
  calls = {n for n, f in vars(CacheMethod).items() if callable(f) and not n.startswith("_")}
  assert calls <= set(vars(sharding.PerShard)), sorted(calls - set(vars(sharding.PerShard)))


def test_per_shard_decides_the_inner_methods_open_settings(monkeypatch):
  """KIVI's mma left open is decided for the inner method on a mesh as on one device, and recorded as it ran."""
  import jkv.attention as attention
  monkeypatch.setattr(attention, "hopper_kernel_takes", lambda rows: True)
  spec = CacheSpec(num_layers=2, batch=4, capacity=256, kv_heads=2, head_dim=64, q_per_kv=3, dtype=jax.numpy.float32)
  on_mesh = sharding.PerShard(make_method("kivi"), abstract_mesh(2, 2), spec).for_impl(spec, "pallas")
  assert on_mesh.inner.mma is True and on_mesh.settings()["mma"] is True


def test_every_method_state_names_batch_and_kv_heads():
  """What sharding the cache needs from each method's abstract: the sequences' axis everywhere, the KV heads'
  wherever an array is per head (counters per sequence are split over data alone)."""
  spec = CacheSpec.for_model(CFG, 4, 64)
  for name in ("dense", "kivi", "fakequant", "zipcache", "ott", "specache"):
    infos = jax.tree.leaves(make_method(name).abstract(spec), is_leaf=lambda x: hasattr(x, "axes"))
    assert infos and all("batch" in i.axes for i in infos), name
    assert any("kv_heads" in i.axes for i in infos), name


def test_largest_batch_on_a_mesh_holds_each_devices_share():
  method = make_method("kivi", bits=2)
  one = largest_batch(CFG, method, 4096, 4096, device_bytes=8 << 30, weight_bytes=0)
  mesh = abstract_mesh(2, 2)
  both = largest_batch(CFG, method, 4096, 4096, device_bytes=8 << 30, weight_bytes=0, mesh=mesh)
  # Every array split 4 ways but counters (data only); beside a prefill sub-batch's fresh state of one sequence per
  # data shard, half a sequence on each device of the mesh against one.
  assert both % 2 == 0 and 3.9 * one <= both <= 4 * one + 4


def run_cli(capsys, argv):
  rc = cli.main(argv)
  return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--mesh", "gpu=2", "hi"], "argument --mesh: mesh spec 'gpu=2': unknown axis 'gpu'"),
    (["generate", "--mesh", "data=8,model=4", "hi"], "mesh data=8,model=4 needs 32 devices (data x model), but "),
    (["eval", "ppl", "--mesh", "model=24"], "mesh data=1,model=24 needs 24 devices"),
    (["compare", "--mesh", "data=23", "--output", ""], "mesh data=23,model=1 needs 23 devices"),
    (["generate", "--mesh", "data=2", "--stream", "hi"], "--stream runs on one device"),
    (["generate", "--coordinator", "localhost:1", "hi"], "needs --coordinator, --num-processes and --process-id"),
])
def test_cli_mesh_errors_are_one_line_before_the_model_loads(capsys, monkeypatch, argv, message):
  loaded = lambda *a: pytest.fail("the model loaded before the mesh was checked")
  monkeypatch.setattr("jkv.load.load_model", loaded)
  monkeypatch.setattr("jkv.load.ModelSource.load", loaded)  # (generate reads the config and tokenizer first)
  rc, err = run_cli(capsys, argv)
  assert rc == 2 and err.count("\n") == 0 and message in err, err


# The sharded suite in two processes of about equal work (about 60 s each on one core): the default model's tests
# (SmolLM2, and the CLI test that reuses its loaded copy) with the tiny Llama's SpeCache, OTT and fakequant cases;
# the tiny Llama's others.
FIRST_HALF = "default_model or cli_mesh or (tiny_model and (specache or ott or fakequant))"


def test_sharded_suite_on_four_cpu_devices():
  """tests/test_sharding_devices.py in processes that see 4 CPU devices (the count is fixed at jax import): two at
  once, split by ``-k`` into complementary halves (every test of the module runs in exactly one), since one process,
  mostly compiling, leaves much of CI's second core idle.

  Both compile without LLVM's optimizations (--xla_backend_optimization_level=0): their programs run for a few
  steps of short prompts, so optimizing their machine code is only compile time (about 40% of it for the tiny
  Llama; the default model's decode runs 3x slower unoptimized, but for 10 tokens). XLA's HLO passes, the SPMD
  partitioner's included, run the same at every backend level: the optimized HLO of every method's prefill and
  decode (XLA and interpret-mode kernels), on the mesh and on one device, is identical at 0 and at the default;
  each test compares the mesh with one device at the same level."""
  xla_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  xla_flags += " --xla_backend_optimization_level=0"
  halves = [FIRST_HALF, f"not ({FIRST_HALF})"]
  procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k",
                             select,
                             os.path.join(ROOT, "tests", "test_sharding_devices.py")],
                            cwd=ROOT, env=dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for select in halves]
  try:
    outputs = [p.communicate(timeout=1800) for p in procs]
  finally:
    for p in procs:
      p.kill()  # the other half, where one timed out (a process that exited is left alone)
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, out[-6000:] + err[-3000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_on_one_mesh_equal_one_device():
  """The multi-host path: jax.distributed with two processes of two CPU devices each, one data=2 x model=2 mesh
  across them (each process holds its own shards), the same tokens as one device (each process's own, afterwards).

  Compiled without LLVM's optimizations, like the sharded suite's processes (test_sharded_suite_on_four_cpu_devices
  says why that compares the same programs): each process took 13 s, 8.7 s so."""
  xla_flags = " --xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + xla_flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT, os.environ.get("PYTHONPATH", "")]))
  port = _free_port()
  script = os.path.join(ROOT, "tests", "sharding_multiprocess.py")
  procs = [subprocess.Popen([sys.executable, script, str(i), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-4000:]
    results.append(json.loads(next(l for l in out.splitlines() if l.startswith("TOKENS "))[len("TOKENS "):]))
  assert sorted(r["process"] for r in results) == [0, 1]
  for r in results:
    assert r["mesh"] == "data=2,model=2" and r["tokens"] == r["one_device_tokens"] == results[0]["tokens"]
    assert r["kv_bytes"] == r["one_device_kv_bytes"]
