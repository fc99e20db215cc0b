"""Findings (contract 5.5): the Distributed tab's questions answered in plain language. No I/O.

A careful SRE's rules: a rank is flagged for what sets it apart from its peers, with evidence sized to
the claim; noise that every rank shows is never a warning. Each rule looks at the (binned) ``ranks x
columns`` matrix of one key and returns rows ``{kind, rank, key, step, severity, message}``; two rules
then look across keys and ranks. The thresholds are fixed (they do not follow the ``outlier_*`` query
parameters, so exploring outliers never changes the answers).

Severity: ``critical``, the job is broken (a rank stopped, NaN or Infinity, ranks out of sync);
``warning``, a rank differs persistently or by a large margin; ``info``, worth a look but likely benign.

The rules come in families, one module each, with their thresholds (module constants) beside them and
the module's docstring stating each of its rules exactly:

- ``coverage.py``: which ranks reported which steps: ``stopped_reporting``, ``missing_steps``
  (:func:`coverage_findings`, from the steps reported, before any key's values).
- ``agreement.py``: values that must be finite or the same on every rank: ``nonfinite``,
  ``rank_disagreement`` (an all-reduced key), and ``weighted_differs``.
- ``peers.py``: each value against its peers' (:class:`PeerView`), and the ranks apart from them or
  noisier: ``persistent_outlier``, ``noisy_rank``.
- ``spikes.py``: brief values far out, judged against the other ranks' rate: ``spike``.
- ``system.py``: the memory and GPU each rank's process samples of itself (contract 2), across those
  keys: ``memory_growth`` (with its forecast), ``memory_high``, ``gpu_idle`` (:func:`system_findings`).
- ``keys.py``: :func:`key_findings`, one key's rules in order (an all-reduced key stops at its
  agreement; spikes are looked for among the ranks neither persistently apart nor noisy), and its
  :class:`KeyResult`.
- ``nodes.py``: :func:`cross_key_findings`, across keys and ranks: ``straggler`` (one rank on two time
  keys) and ``node_outlier`` (half a node's ranks sharing a finding), each replacing the rows it
  explains; and :func:`name_hosts`, the host of each finding's rank where the run's record knows it
  (what to look at next), added by the callers that hold the record: the summary's route and the watch.
- ``clock.py``: wall-clock rules the watch adds (see ``shared/watch/rounds.py``): ``stopped_reporting`` by
  time and ``stalled``.
- ``common.py``: the row (``Finding``, its ``severity`` one of ``shared.severity``'s) and its wording,
  the most severe first (``worst_first``), and what several families use (``TIME_KEY``, ``SPIKE_FOLD``,
  the Poisson tail).

``shared.summary.document`` calls ``coverage_findings``, then ``key_findings`` for each key, then
``system_findings`` over the system keys, then ``cross_key_findings`` over all their rows.

A healthy job (independent or heavy-tailed noise, rare brief stalls on random ranks, stalls of every
rank at once, warm-up, uneven noise levels up to 1.5x, uneven but unbiased weights) raises no
``warning`` or ``critical`` row: ``benchmarks/findings_quality.py`` measures this and each fault.
"""

# tests/unit/test_findings.py holds the all-reduced check's shortcuts to its plain form.
from shared.findings.agreement import _agreeing_columns as _agreeing_columns
from shared.findings.agreement import _agreement as _agreement
from shared.findings.agreement import _all_reduced_agreement as _all_reduced_agreement
from shared.findings.common import TIME_KEY, Finding, is_time_key, worst_first
from shared.findings.coverage import RolledCoverage, coverage_findings
from shared.findings.keys import KeyResult, key_findings
from shared.findings.nodes import NODE_KINDS, cross_key_findings, name_hosts
from shared.findings.peers import Offset, PeerView, peer_view
from shared.findings.spikes import spike_threshold
from shared.findings.system import is_system_key, system_findings

__all__ = [
    "NODE_KINDS",
    "TIME_KEY",
    "Finding",
    "KeyResult",
    "Offset",
    "PeerView",
    "RolledCoverage",
    "coverage_findings",
    "cross_key_findings",
    "is_system_key",
    "is_time_key",
    "key_findings",
    "name_hosts",
    "peer_view",
    "spike_threshold",
    "system_findings",
    "worst_first",
]
