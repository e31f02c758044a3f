#!/usr/bin/env bash
# issue 33: our OpenAI-compatible server vs llama-server, same chat prompts (GEC instruction as the
# system message, JFLEG dev sentences as user messages), 16 requests, 1 and 8 concurrent clients,
# alternated; qwen2.5-0.5b (ours: bf16 from the GGUF; llama.cpp: the GGUF's own q5_0/q4_K weights)
cd "$(dirname "$0")/.."; export GRADIO_ANALYTICS_ENABLED=False  # run with the venv active
D=../shared/data; M=${OUT:-bench-out}; mkdir -p $M; A=${ANCHORS:-~/.cache/specsuite-anchors}
wait_up() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
specsuite serve --model qwen2.5-0.5b --port 8765 --no-ui --batch-size 8 > $M/serve_ours.log 2>&1 &
P=$!; wait_up 8765 || echo "ours did not start"
specsuite bench-openai --base-url http://127.0.0.1:8765/v1 --model specsuite-gec --prompts $D/jfleg/dev.src -n 16 --concurrency 1,8,1,8 --max-tokens 128 > $M/openai_ours.json 2>$M/openai_ours.err
specsuite bench-openai --base-url http://127.0.0.1:8765/v1 --model qwen2.5-0.5b --gec-system --prompts $D/jfleg/dev.src -n 16 --concurrency 1,8,1,8 --max-tokens 128 > $M/openai_ours_chat.json 2>$M/openai_ours_chat.err
kill $P; wait $P 2>/dev/null
for spec in none ngram-simple; do
  extra=""; [ $spec = ngram-simple ] && extra="--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16"
  $A/llama.cpp/build/bin/llama-server -m $A/qwen2.5-0.5b.gguf --port 8766 -t 2 -tb 2 -np 8 -c 8192 -cb --temp 0 --top-k 1 $extra > $M/llama_$spec.log 2>&1 &
  P=$!; wait_up 8766 || echo "llama-server did not start"
  specsuite bench-openai --base-url http://127.0.0.1:8766/v1 --model qwen2.5-0.5b --gec-system --prompts $D/jfleg/dev.src -n 16 --concurrency 1,8,1,8 --max-tokens 128 > $M/openai_llama_$spec.json 2>$M/openai_llama_$spec.err
  kill $P; wait $P 2>/dev/null
done
echo done
