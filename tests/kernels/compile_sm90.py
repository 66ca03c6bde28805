"""Compile the kernels for an H100 (sm_90) without a GPU and print each one's resource use as JSON lines.

Run as a script in a process *without* TRITON_INTERPRET (the interpreter replaces the compiler).
It goes through Triton's real front end, optimizer and ptxas, which the interpreter never touches, with
the launch-time specializations a real call gets (pointers 16-byte aligned, strides divisible by 16):
``{"name": ..., "registers": int, "spill_bytes": int, "shared_bytes": int}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llm_api.kernels import activation, decode_attention, kv_write, prefill_attention, rms_norm, rotary

BF16_ATTENTION = {"query_ptr": "*bf16", "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16", "out_ptr": "*bf16",
                  "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_out_ptr": "*fp32",
                  "scaling": "fp32", "softcap": "fp32"}


def compile_one(name, fn, types, constexprs, num_warps=4, num_stages=3):
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
               if arg not in constexprs and (signature[arg].startswith("*") or arg.startswith("stride"))}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spill = int(re.search(r"STACK:(\d+)", usage).group(1))
    print(json.dumps({"name": name, "registers": registers, "spill_bytes": spill,
                      "shared_bytes": kernel.metadata.shared}))


def main():
    decode = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=decode_attention.BLOCK_N,
                  HAS_WINDOW=True, HAS_SOFTCAP=False, DOT_PRECISION="tf32", DOT_UPCAST=False)
    compile_one("decode-gqa8-split", decode_attention._decode_partition_kernel, BF16_ATTENTION,
                dict(decode, GROUP=8, GROUP_PAD=16, NUM_PARTITIONS=16, USE_DOT=True))
    compile_one("decode-mha-direct", decode_attention._decode_partition_kernel, BF16_ATTENTION,
                dict(decode, GROUP=1, GROUP_PAD=1, NUM_PARTITIONS=1, USE_DOT=False))
    compile_one("decode-reduce", decode_attention._decode_reduce_kernel, BF16_ATTENTION,
                dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=decode_attention.BLOCK_N, NUM_PARTITIONS=16,
                     HAS_WINDOW=True, CHUNK=16))
    compile_one("prefill-gqa4-window-softcap", prefill_attention._prefill_kernel, BF16_ATTENTION,
                dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=4, BLOCK_Q=prefill_attention.BLOCK_M // 4, HEAD_DIM=128,
                     HEAD_DIM_PAD=128, BLOCK_N=prefill_attention.BLOCK_N, HAS_WINDOW=True, HAS_SOFTCAP=True,
                     DOT_PRECISION="tf32", DOT_UPCAST=False))
    compile_one("store-kv", kv_write._store_kv_kernel,
                {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16",
                 "slot_mapping_ptr": "*i64"},
                dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128))
    # The fused layers' kernels at Llama-3.1-8B's sizes (hidden 4096, head dim 128), bf16.
    norm = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16",
            "eps": "fp32"}
    compile_one("rms-norm", rms_norm._rms_norm_kernel, norm, dict(BLOCK=4096), num_warps=16)
    compile_one("add-rms-norm", rms_norm._add_rms_norm_kernel, norm, dict(BLOCK=4096), num_warps=16)
    compile_one("silu-and-mul", activation._silu_and_mul_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"},
                dict(BLOCK=activation.BLOCK))
    rope = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "key_cache_ptr",
                                        "value_cache_ptr", "cos_ptr", "sin_ptr")}
    compile_one("rotary", rotary._rotary_kernel, rope, dict(BLOCK=64), num_warps=1)
    compile_one("rotary-store-kv", rotary._rotary_store_kv_kernel, {**rope, "slot_ptr": "*i64"}, dict(BLOCK=64),
                num_warps=1)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the compiler")
    main()
