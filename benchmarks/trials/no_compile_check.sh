#!/usr/bin/env bash
# Trial (GPU, one command, ~5-6 min on an H100, at most ~8 by its timeouts): no Triton compile after engine start-up, and no kernel slower.
#   1. tests/test_jit_warmup.py, GPU and CPU-style tests (the engine with and without CUDA graphs: zero
#      compiles over steps of many sizes after start-up; the start-up warm-up time is printed);
#   2. benchmarks/trials/specialize_ab.py: kernels with do_not_specialize vs Triton's default specialization;
#   3. the specialization put back by hand in a copy of the tree (tile_scatter_kernel, rope_store_kv_kernel):
#      the same tests must fail.
#     bash benchmarks/trials/no_compile_check.sh        # from the repo root; writes to $OUT if set
set -u
ROOT=$(pwd)
OUT=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT
SEL='gpu or not gpu'

echo "== 1. tests (warm-up, then zero compiles)"
timeout 260 python -m pytest -q -s -p no:cacheprovider tests/test_jit_warmup.py -m "$SEL" 2>&1 | tee "$OUT/no_compile_tests.log" \
    | grep -E "warm-up at start-up|passed|failed|Error|Triton compiles|kernel variants|^E  " | head -40
TESTS_RC=${PIPESTATUS[0]}

echo "== 2. speed: do_not_specialize vs default specialization"
timeout 110 python benchmarks/trials/specialize_ab.py --out "$OUT" 2>&1 | tail -30
AB_RC=${PIPESTATUS[0]}

echo "== 3. mutation: the specialization of tile_scatter_kernel and rope_store_kv_kernel put back"
MUT=$(mktemp -d /tmp/no_compile_mut.XXXX)
cp -r "$ROOT"/. "$MUT"
python - "$MUT" <<'EOF'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
for path, kernel in (("moe_infer/kernels/permute_rows.py", "tile_scatter_kernel"),
                     ("moe_infer/kernels/rope_kv.py", "rope_store_kv_kernel")):
    p = root / path
    src = p.read_text()
    out = re.sub(r"@triton\.jit\(do_not_specialize=\[[^\]]*\]\)\ndef " + kernel, "@triton.jit\ndef " + kernel, src)
    assert out != src, kernel
    p.write_text(out)
EOF
(cd "$MUT" && PYTHONPATH=$MUT timeout 100 python -m pytest -q -p no:cacheprovider tests/test_jit_warmup.py \
    -m "$SEL" -k "qwen3 or eager" > "$OUT/no_compile_mutation.log" 2>&1)
MUT_RC=$?
grep -E "passed|failed|^E  .*(T=|prefill|decode|Triton compiles|kernel variants)" "$OUT/no_compile_mutation.log" | head -12
rm -rf "$MUT"

echo "== SUMMARY"
echo "tests after the change: $([ "$TESTS_RC" -eq 0 ] && echo PASS || echo "FAIL (rc $TESTS_RC, log $OUT/no_compile_tests.log)")"
grep -h "warm-up at start-up" "$OUT/no_compile_tests.log" || true
echo "speed trial: rc $AB_RC (table above; JSON in $OUT)"
echo "mutation: $([ "$MUT_RC" -ne 0 ] && echo "CAUGHT (the tests fail with the specialization put back)" || echo "MISSED")"
