"""What `--min-relevance` does to answers on Spec-Bench RAG dev (docs/benchmarks.md, RAG under load).

Spec-Bench items come with their passages, no scores: this scores them as `ask` would (the index's
embedding model, cosine), keeps those at or above R times the best (`retrieval.relevant`), and
answers each item whose passages change both ways (an item that keeps all its passages gets the
same prompt, so the same answer). Run from a checkout with the model fetched:

    python docs/rag_relevance_check.py ../shared/data/specbench/rag_dev.jsonl [R]
"""

import json
import sys

import numpy as np

from specsuite.apps.rag.evaluate import contains_reference, references
from specsuite.apps.rag.qa import RagQA
from specsuite.models import DEFAULT_EMBEDDING_MODEL
from specsuite.retrieval import Embedder, parse_specbench_rag, relevant

path, ratio = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
items = [json.loads(line) for line in open(path)][:40]
embedder, qa = Embedder(DEFAULT_EMBEDDING_MODEL), RagQA()
changed = dropped = full_right = kept_right = 0
for n, item in enumerate(items, 1):
    passages, question = parse_specbench_rag(item)
    scores = np.asarray(embedder.encode(passages)) @ np.asarray(embedder.encode([question]))[0]
    kept = [p for p, _ in relevant(list(zip(passages, scores.tolist())), ratio)]
    if len(kept) == len(passages):
        continue
    refs = references(item)
    full, cut = (qa.answer(question, ps).text for ps in (passages, kept))
    changed, dropped = changed + 1, dropped + len(passages) - len(kept)
    full_right += contains_reference(full, refs)
    kept_right += contains_reference(cut, refs)
    print(json.dumps({"item": n, "kept": f"{len(kept)}/{len(passages)}", "references": refs,
                      "all_passages": full, "kept_passages": cut}), flush=True)
print(f"min_relevance {ratio}: {changed} of {len(items)} items lose passages ({dropped} passages); reference in "
      f"the answer on those items: {full_right} with all passages, {kept_right} with the kept ones")
