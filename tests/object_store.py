"""An S3-compatible server of the tests' own on the loopback interface: moto's server (from the
package index, `moto[server]` in the dev extra: a pure-Python S3 that needs no binary, no Docker
and no account), started on a free port, with the environment the AWS clients read pointed at it
(AWS_ENDPOINT_URL and dummy credentials), so s3:// URLs in this process and in the processes it
starts reach it and nothing else."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import urllib.request

# What the AWS clients (botocore under s3fs) read; dummy keys: the server accepts any.
ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
            "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED", "JAXTRAIN_STAGING_DIR")


@contextlib.contextmanager
def s3_server(bucket: str = "jaxtrain-test"):
  """Yields (endpoint URL, bucket) with the server running and this process's environment set;
  restores the environment and stops the server after."""
  from moto.server import ThreadedMotoServer  # pylint: disable=import-outside-toplevel
  logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  host, port = server.get_host_and_port()
  endpoint = f"http://{host}:{port}"
  # moto keeps its buckets in this process's memory, shared by every server it starts: begin
  # with none, whatever an earlier test module left.
  urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))
  saved = {k: os.environ.get(k) for k in ENV_KEYS}
  os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                    AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                    AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                    # Staging copies of this server's buckets in a directory of their own: two
                    # test workers' servers hold buckets of the same name.
                    JAXTRAIN_STAGING_DIR=tempfile.mkdtemp(prefix="jaxtrain-staging-"))
  try:
    import s3fs  # pylint: disable=import-outside-toplevel
    s3fs.S3FileSystem.clear_instance_cache()  # clients made for another endpoint
    s3fs.S3FileSystem().mkdir(bucket)
    yield endpoint, bucket
  finally:
    shutil.rmtree(os.environ["JAXTRAIN_STAGING_DIR"], ignore_errors=True)
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    import s3fs  # pylint: disable=import-outside-toplevel
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def upload(local_dir: str, url: str) -> None:
  """Copies a local directory's files to `url` (s3://BUCKET/PREFIX), a manifest.json last, as a
  careful `aws s3 cp` of a prepared corpus would."""
  import s3fs  # pylint: disable=import-outside-toplevel
  fs = s3fs.S3FileSystem()
  names = sorted(os.listdir(local_dir), key=lambda n: n == "manifest.json")
  for name in names:
    fs.put_file(os.path.join(local_dir, name), f"{url.rstrip('/')}/{name}")
