"""benchmarks/deviceless_step.py's reading of an optimized HLO module: the layer loop's and the step loop's kernels
(the compile for a GPU itself needs jax's CUDA plugin, which CI does not install). The module below is written by
hand in the shape XLA:GPU gives a decode chunk: a step loop whose body holds a layer loop, the layer body a
conditional and an inner loop."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import deviceless_step  # noqa: E402

HLO = """HloModule jit__decode_chunk

%branch_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %loop_add_fusion.9 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_add.9
}

%branch_b (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %copy.3 = f32[4]{0} copy(%p)
  ROOT %custom-call.1 = f32[4]{0} custom-call(%copy.3), custom_call_target="mosaic_gpu_v2"
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %loop_tuple_fusion = (s32[], f32[4]{0}) fusion(%t), kind=kLoop, calls=%fused_tuple
}

%layer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %input_reduce_fusion.2 = f32[] fusion(%x), kind=kCustom, calls=%fused_reduce.2, {REDUCE_METADATA}
  %pallas_call.0 = f32[4]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %loop_select_fusion = f32[4]{0} fusion(%pallas_call.0, %x), kind=kLoop, calls=%fused_select
  %pick = s32[] constant(0)
  %conditional.1 = f32[4]{0} conditional(%pick, %loop_select_fusion, %loop_select_fusion),
      branch_computations={%branch_a, %branch_b}
  %i = s32[] get-tuple-element(%t), index=0
  %tuple.1 = (s32[], f32[4]{0}) tuple(%i, %conditional.1)
  ROOT %while.3 = (s32[], f32[4]{0}) while(%tuple.1), condition=%layer_cond, body=%inner_body
}

%layer_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(32)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%step_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %loop_broadcast_fusion = f32[4]{0} fusion(), kind=kLoop, calls=%fused_broadcast
  %while.2 = (s32[], f32[4]{0}) while(%t), condition=%layer_cond, body=%layer_body
  ROOT %input_scatter_fusion = (s32[], f32[4]{0}) fusion(%while.2, %loop_broadcast_fusion), kind=kInput,
      calls=%fused_scatter
}

%step_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4]{0}) while(%a), condition=%step_cond, body=%step_body
}
""".replace("{REDUCE_METADATA}", 'metadata={op_name="jit(_decode_chunk)/while/body/eval_jaxpr/cache_step/reduce_sum"}, '
            'backend_config={"fusion_backend_config":{"kind":"__triton"}}')


def test_loops_find_the_layer_and_step_bodies_and_their_kernels():
  found = deviceless_step.loops(HLO)
  layer_name, layer, branches = found["layer"]
  step_name, step, step_branches = found["step"]
  assert (layer_name, step_name) == ("layer_body", "step_body")
  assert [(k["name"], k["op"], k["kind"]) for k in layer] == [
      ("input_reduce_fusion.2", "fusion", "__triton"), ("pallas_call.0", "custom-call", "__gpu$xla.gpu.triton"),
      ("loop_select_fusion", "fusion", "kLoop")]
  assert layer[0]["what"] == "cache_step/reduce_sum"  # the jit and loop prefixes dropped
  assert {name: [k["kind"] for k in ks] for name, ks in branches.items()} == {
      "branch_a": ["kLoop"], "branch_b": ["", "mosaic_gpu_v2"], "loop inner_body": ["kLoop"]}
  assert [(k["name"], k["kind"]) for k in step] == [("loop_broadcast_fusion", "kLoop"), ("input_scatter_fusion",
                                                                                         "kInput")]
  assert step_branches == {}
  assert deviceless_step.summary(layer) == {"fusion:__triton": 1, "custom-call:__gpu$xla.gpu.triton": 1,
                                            "fusion:kLoop": 1}
