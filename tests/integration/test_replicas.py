"""Replica parameters refused before anything starts. The replicas shape end to end (router, key, shares, a replica
killed mid-sweep, units) is test_multinode.py's replicas on two machines; two replicas on this machine, interrupted
mid-benchmark, are test_faults.py's."""

import pytest

from servebook import params

pytestmark = pytest.mark.integration


def test_replica_parameters_that_cannot_work_are_refused_before_anything_starts():
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "port": 8000, "replica_base_port": 7999, "ab_variants": []})
    assert "replica_base_port 7999 puts a replica on port 8000" in str(err.value)
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "ab_variants": [{"name": "x", "extra_env": {"NCCL_PROTO": "LL"}}]})
    assert "ab_variants" in str(err.value) and "replicas" in str(err.value)
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "tensor_parallel_size": 2, "gpu_ids": [0, 1]})
    assert "x replicas 2 = 4; list exactly 4" in str(err.value)
