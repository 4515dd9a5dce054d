"""One tiny model served once per session (loopback, free port), shared by the serve tests."""

import pytest
from serve_testlib import make_tiny_hf

from jaxrl import models, sampling, serve


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
  return make_tiny_hf(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="session")
def tiny_sampler(tiny_dir):
  tok = models.load_tokenizer(tiny_dir)
  return sampling.Sampler(models.load_pretrained(tiny_dir, dtype="float32"), tok, max_len=128)


@pytest.fixture(scope="session")
def server(tiny_sampler):
  app = serve.create_app(tiny_sampler, model_name="tiny", max_batch_rows=32, batch_wait_s=0.3)
  with serve.ServerThread(app, port=0) as srv:
    yield srv, app


@pytest.fixture(scope="session")
def client(server):
  import openai
  return openai.OpenAI(base_url=server[0].url, api_key="unused", max_retries=0, timeout=120)
