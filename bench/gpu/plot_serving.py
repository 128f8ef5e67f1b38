"""Plot bench/gpu/serving.py's JSON: KV capacity, time to first token and time per output token, BF16 vs FP8 KV.

    python bench/gpu/plot_serving.py bench/h200-vllm-serving.json bench/h200-vllm-serving.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    report = json.load(open(src))
    arms = report["arms"]
    names = list(arms)
    lengths = list(next(iter(arms.values()))["latency"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    axes[0].bar(names, [arms[n]["capacity_tokens"] / 1e6 for n in names], color=["C0", "C1"])
    axes[0].set_title("KV-cache capacity (M tokens)")
    width = 0.38
    for i, (key, title, scale) in enumerate((("ttft_s", "time to first token (s)", 1),
                                             ("tpot_s", "time per output token (ms)", 1e3))):
        ax = axes[i + 1]
        for j, n in enumerate(names):
            xs = [k + (j - 0.5) * width for k in range(len(lengths))]
            ax.bar(xs, [arms[n]["latency"][L][key] * scale for L in lengths], width, label=n, color=f"C{j}")
        ax.set_xticks(range(len(lengths)), [f"{int(L) // 1024}K" for L in lengths])
        ax.set_title(title)
        ax.set_xlabel("prompt tokens")
        ax.legend()
    tp = [arms[n]["throughput"] for n in names]
    axes[3].bar([f"{n}\nbatch {t['batch']}" for n, t in zip(names, tp)], [t["output_tokens_per_s"] for t in tp],
                color=["C0", "C1"])
    axes[3].set_title(f"output tokens/s ({tp[0]['prompt_tokens']}+{tp[0]['output_tokens']} per request)")
    fig.suptitle(f"{report['model']} on {report['gpu']}, vLLM {report['vllm']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(*sys.argv[1:3])
