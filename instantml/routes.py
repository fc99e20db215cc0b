"""The HTTP API's paths (contract 3.3), declared once for the client, the handlers and the tests.

``template.yaml`` wires the same paths to the functions; a drift test keeps the two equal.
"""

import re

RANK_METRICS = "/v1/projects/{project}/runs/{run_id}/rank-metrics"
RANK_METRICS_BATCH = "/v1/projects/{project}/runs/{run_id}/rank-metrics/batch"
DISTRIBUTED = "/v1/projects/{project}/runs/{run_id}/distributed"
DISTRIBUTED_VIEW = "/v1/projects/{project}/runs/{run_id}/distributed/view"
SCALARS = "/v1/projects/{project}/runs/{run_id}/scalars"
SCALARS_BATCH = "/v1/projects/{project}/runs/{run_id}/scalars/batch"
RUN = "/v1/projects/{project}/runs/{run_id}"
RUNS = "/v1/projects/{project}/runs"
RUNS_VIEW = "/v1/projects/{project}/view"
RUN_VIEW = "/v1/projects/{project}/runs/{run_id}/view"
COMPARE_VIEW = "/v1/projects/{project}/compare/view"  # the runs to compare in its fragment: #runs=a,b
ALERTS = "/v1/projects/{project}/alerts"


def path_pattern(route: str) -> re.Pattern[str]:
    """A route as a regex of the paths it serves: each ``{name}`` one path segment, a named group.

    >>> path_pattern(RUN).match("/v1/projects/p/runs/r").group("run_id")
    'r'
    """
    # \Z, not $: Python's $ also matches before a trailing newline.
    return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(route)) + r"\Z")
