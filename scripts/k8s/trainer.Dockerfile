# The end-to-end tests' trainer image: the project's image + the client's torch extra (CPU torch). Built by
# scripts/k8s/images.sh with a context holding at most this file and the machine's CPU torch wheel.
ARG BASE=mixplane:0.1.0
FROM ${BASE}
ARG TORCH=torch==2.13.0
USER 0
COPY . /tmp/wheels/
# the wheel in the context when there is one (the CPU build), else the pin from PyPI
# (the project's image has no pip: ensurepip brings it back for this install and it goes again after)
RUN set -e; w=$(ls /tmp/wheels/torch-*.whl 2>/dev/null | head -1); \
    /opt/mixplane/bin/python -m ensurepip > /dev/null; \
    /opt/mixplane/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check "${w:-$TORCH}"; \
    /opt/mixplane/bin/python -m pip uninstall -y -q pip; \
    rm -rf /tmp/wheels; /opt/mixplane/bin/python -c "import torch, mixplane.client"
USER 10001:10001
