"""FLOPs of one denoising step of a Flux denoiser, mask-aware over full, against the per-op prediction.

    retouch bench flops --model flux-small --mask-ratios 0.1,0.2,0.5,1.0 [--out F.json]

`flops_ratio` is counted (torch.utils.flop_counter, SDPA on its math path so attention is counted);
`theory` is the paper's Table 1 made exact for the architecture (`retouch.flops.flux_forward_macs`:
masked tokens for token-wise ops, masked queries x all keys for attention, text tokens always).
"""

from __future__ import annotations

from pathlib import Path

import torch

from retouch.adapters import MaskAwareContext
from retouch.bench.report import environment, mask_ratios, out_path, publish, pyplot
from retouch.bench.step import MODES, TEXT_TOKENS, flux_setup
from retouch.errors import COMMON_HELP, ArgumentParser
from retouch.flops import count_flops, flux_forward_macs
from retouch.masks import centred_token_rectangle
from retouch.progress import bar


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench flops", description=__doc__)
    parser.add_argument("--model", default="flux-small", choices=sorted(TEXT_TOKENS))
    parser.add_argument("--mask-ratios", dest="ratios", type=mask_ratios, help=COMMON_HELP["mask_ratios"],
                        default="0.1,0.2,0.5,1.0")
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")
    args = parser.parse_args(argv)

    device = torch.device("cpu")  # FLOPs do not depend on the device
    transformer, adapter, inputs, cache, grid, num_text = flux_setup(args.model, device, torch.float32)
    num_image = grid[0] * grid[1]
    full_flops, _ = count_flops(transformer, inputs)
    full_theory = flux_forward_macs(transformer.config, num_text, num_image, num_image, None)
    results = []
    points = bar([(float(ratio), mode) for ratio in args.ratios for mode in MODES],
                 "flops: mask-aware vs full", unit="point")
    for ratio, mode in points:
        masked = centred_token_rectangle(grid, ratio)
        context = MaskAwareContext.edit(MODES[mode], [masked], ["template"], [0], num_text, num_image, cache)
        with adapter.run(context):
            flops, _ = count_flops(transformer, inputs)
        theory = flux_forward_macs(transformer.config, num_text, num_image, len(masked), MODES[mode]) / full_theory
        results.append({"mask_ratio": round(len(masked) / num_image, 4), "mode": mode, "flops": flops,
                        "flops_ratio": round(flops / full_flops, 4), "theory": round(theory, 4)})
        points.set_postfix_str(f"m={results[-1]['mask_ratio']} {mode}: {results[-1]['flops_ratio']} "
                               f"(theory {results[-1]['theory']})", refresh=False)
    report = {**environment("flops", argv, device), "model": args.model, "image_tokens": num_image,
              "text_tokens": num_text, "full_flops": full_flops, "results": results}
    return publish(report, args.out, plot)


def plot(report: dict, path: Path) -> None:
    """Counted FLOPs over full compute against the mask ratio, per mode, with the prediction."""
    plt = pyplot()
    if plt is None:
        return
    figure, axis = plt.subplots(figsize=(5.5, 4))
    for mode in MODES:
        rows = [row for row in report["results"] if row["mode"] == mode]
        ratios = [row["mask_ratio"] for row in rows]
        line, = axis.plot(ratios, [row["flops_ratio"] for row in rows], marker="o", label=f"{mode}, counted")
        axis.plot(ratios, [row["theory"] for row in rows], linestyle=":", color=line.get_color(),
                  label=f"{mode}, predicted")
    axis.plot([0, 1], [0, 1], color="grey", linewidth=0.8, label="mask ratio")
    axis.set_xlabel("mask ratio")
    axis.set_ylabel("FLOPs / full compute")
    axis.set_title(f"{report['model']}: {report['image_tokens']} image + {report['text_tokens']} text tokens")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
