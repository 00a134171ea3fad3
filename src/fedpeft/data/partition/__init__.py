"""Split a centralised dataset into per-client shards for federated experiments.

Every partitioner returns a list with one entry per client; each entry is a
sorted ``int64`` array of indices into the dataset, and every sample belongs to
exactly one client. All randomness comes from a caller-supplied
:class:`numpy.random.Generator`, so a partition is reproducible from its seed.

Schemes
-------
``partition_iid``
    Seeded shuffle cut into near-equal parts.
``partition_dirichlet``
    Label skew from a Dirichlet draw, in one of three modes (``DIRICHLET_MODES``):
    per class over clients (uncapped, or capped at the mean client size as in
    FedNLP, which C2A follows), or per client over classes (the FeDeRA paper).
    Small ``alpha`` makes clients nearly single-class, large ``alpha`` approaches iid.
``partition_similarity``
    SCAFFOLD-style mixture (as used by PF2LoRA): a share ``1 - s`` is spread
    iid and the share ``s`` is sorted by label and dealt out in contiguous
    chunks. ``s = 0`` is iid, ``s = 1`` is the most heterogeneous.
``partition_natural``
    One client per natural group (writer, speaker, task, ...), optionally
    merged into fewer, size-balanced clients.
``partition_groups``
    The C2A paper's language partition (sec. 4.2, after Weller et al., 2022):
    clients are divided into groups, each bound to one value of a column (a
    language), and each group's examples are split among its clients by the
    Dirichlet label skew above. Clients of a group are numbered consecutively,
    groups in order of first appearance.

Helpers split each client into local train/test parts, summarise label skew as
per-client histograms and their mean pairwise Jensen-Shannon divergence, and
draw those histograms as a heatmap. The package needs only numpy; matplotlib is
imported lazily by :func:`plot_label_heatmap`.

Modules: ``dirichlet`` (the Dirichlet skew), ``schemes`` (the other schemes and the
local split), ``stats`` (skew statistics, heatmap), ``checks`` (what they all check).
"""

from fedpeft.data.partition.checks import PartitionError
from fedpeft.data.partition.dirichlet import DIRICHLET_MODES, partition_dirichlet
from fedpeft.data.partition.schemes import (
    GROUP_CLIENTS,
    client_groups,
    group_client_counts,
    partition_groups,
    partition_iid,
    partition_natural,
    partition_similarity,
    split_local_test,
)
from fedpeft.data.partition.stats import label_histograms, mean_pairwise_js, plot_label_heatmap

__all__ = [
    "DIRICHLET_MODES",
    "GROUP_CLIENTS",
    "PartitionError",
    "client_groups",
    "group_client_counts",
    "label_histograms",
    "mean_pairwise_js",
    "partition_dirichlet",
    "partition_groups",
    "partition_iid",
    "partition_natural",
    "partition_similarity",
    "plot_label_heatmap",
    "split_local_test",
]
