"""Pull a run into pandas and put one rank beside the others: a notebook's cells, as a script.

    INSTANTML_API_URL=http://127.0.0.1:8787 INSTANTML_API_KEY=... \\
        python examples/read_back.py --project distributed-job RUN [--key train/loss] [--rank 5]

Needs ``pip install 'instantml[read]'`` (numpy, pandas); with matplotlib installed it also saves
``RUN-KEY.png``: the chosen rank's line over the band of its peers (their 5th to 95th percentile).
"""

from __future__ import annotations

import argparse

import instantml as im

# %% Which run, which key, which rank
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--project", required=True)
parser.add_argument("run_id", metavar="RUN")
parser.add_argument("--key", default="train/loss")
parser.add_argument("--rank", type=int, default=None, help="default: the rank farthest from the median")
args = parser.parse_args()

# %% Every value of the key, at full resolution, as a long frame (step, rank, key, value, weight, time)
run = im.Api().run(args.project, args.run_id)
frame = run.rank_metrics(keys=[args.key]).to_pandas()
print(f"{args.project}/{args.run_id}: {len(frame):,} values of {args.key}, status {run.status}")

# %% Ranks as columns, steps as rows
wide = frame.pivot_table(index="step", columns="rank", values="value", aggfunc="last")
median = wide.median(axis=1)

# %% The rank to look at: the one that sits farthest from the median on average, unless asked
distance = wide.sub(median, axis=0).abs().mean()
rank = args.rank if args.rank is not None else int(distance.idxmax())
others = wide.drop(columns=[rank])
table = (
    wide[[rank]]
    .rename(columns={rank: f"rank {rank}"})
    .assign(
        median_of_others=others.median(axis=1),
        p05=others.quantile(0.05, axis=1),
        p95=others.quantile(0.95, axis=1),
    )
)
print(table.describe().T[["mean", "min", "max"]])
outside = (table[f"rank {rank}"] > table.p95) | (table[f"rank {rank}"] < table.p05)
print(f"rank {rank} is outside its peers' 5-95% band at {int(outside.sum())} of {len(table)} steps")

# %% A picture, where matplotlib is installed
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("(pip install matplotlib for the plot)")
else:
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.fill_between(table.index, table.p05, table.p95, alpha=0.3, label="other ranks, 5-95%")
    ax.plot(table.index, table.median_of_others, lw=1, label="other ranks, median")
    ax.plot(table.index, table[f"rank {rank}"], lw=1.5, label=f"rank {rank}")
    ax.set_xlabel("step")
    ax.set_ylabel(args.key)
    ax.legend()
    name = f"{args.run_id}-{args.key.replace('/', '_')}.png"
    fig.savefig(name, dpi=120, bbox_inches="tight")
    print(f"saved {name}")
