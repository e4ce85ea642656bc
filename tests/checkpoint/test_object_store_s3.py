"""Checkpoints on S3, against a real S3-compatible server on the loopback (moto's server mode):
saved, committed, rotated and resumed bitwise; a bucket that does not exist fails at fit start."""

import pytest

from fitforge.checkpoint.files import load_checkpoint
from fitforge.exceptions import FitforgeValueError
from objectstore import assert_same, listing, local_s3, s3, storage_options, train

pytestmark = pytest.mark.integration  # a moto S3 server on the loopback


@pytest.fixture(scope="module")
def endpoint():
    with local_s3() as address:
        yield address


def test_saves_rotate_and_resume_from_s3_exactly(endpoint, tmp_path):
    options = storage_options(endpoint)
    uninterrupted, _ = train(str(tmp_path), epochs=3)
    _, saver = train("s3://bucket/run", epochs=2, max_checkpoints=2, storage_options=options)
    assert listing(s3(endpoint), "bucket/run") == [
        "model-epoch1batch8.pt",
        "model-epoch1batch8.pt.commit",
        "model-epoch2batch12.pt",
        "model-epoch2batch12.pt.commit",
    ]
    assert str(saver.saved[-1]) == "s3://bucket/run/model-epoch2batch12.pt"
    local = load_checkpoint(tmp_path / "model-epoch2batch12.pt")
    remote = saver.io.read("model-epoch2batch12.pt")
    assert_same(remote["model"], local["model"])  # the same state, whichever store holds it
    weights, resumed = train("s3://bucket/run", epochs=3, seed=7, resume_from_checkpoint=True, storage_options=options)
    assert resumed.resumed_from.name == "model-epoch2batch12.pt"
    assert_same(weights, uninterrupted)


def test_a_bucket_that_does_not_exist_fails_at_fit_start_naming_the_url(endpoint):
    with pytest.raises(FitforgeValueError, match=r"model_dir 's3://no-such-bucket/run' cannot be written .*bucket"):
        train("s3://no-such-bucket/run", epochs=1, storage_options=storage_options(endpoint))
