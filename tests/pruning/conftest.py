"""Tests of this folder run on one torch thread (see ``one_torch_thread`` in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield
