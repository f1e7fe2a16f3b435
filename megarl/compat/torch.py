"""Patches of torch internals (torch 2.13.0); each names what it works around.

- ``gloo_group_bound_to``: a bare gloo group whose device binds a chosen address (torch binds the host name's).

Every patch here is written for torch 2.13.0 and refuses another version (``compat.require``).
"""

from __future__ import annotations

import torch

from megarl.compat import require

VERSION = "2.13.0"


def gloo_group_bound_to(address: str, host: str, port: int, rank: int, world_size: int, timeout, listen_socket):
    """vLLM's stateless gloo group (``stateless_init_torch_distributed_process_group``), with its gloo device bound
    to ``address`` (the one this process reaches ``host`` from; ``host`` itself on rank 0, which serves the store
    there). torch's default device binds the host name's address: 127.0.1.1 on Debian, loopback where the name
    does not resolve, maybe another network on a multi-homed node — advertised to the other ranks, who then dial
    their own host. Built from ``ProcessGroupGloo``'s private ``_Options``/``create_device`` and
    ``ProcessGroup._register_backend`` (torch 2.13.0), which vLLM's helper does not expose."""
    require("torch", VERSION)
    from torch.distributed import PrefixStore, ProcessGroup, ProcessGroupGloo
    from torch.distributed.distributed_c10d import _get_default_timeout
    from torch.distributed.rendezvous import rendezvous
    from vllm.distributed.utils import create_tcp_store, get_tcp_uri

    timeout = timeout or _get_default_timeout("gloo")
    init_method = get_tcp_uri(host, port)
    if listen_socket is not None:
        store = create_tcp_store(host, port, listen_socket=listen_socket, world_size=world_size, is_master=True,
                                 timeout=timeout, multi_tenant=True)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = PrefixStore(init_method, store)
    options = ProcessGroupGloo._Options()
    options._timeout, options._threads = timeout, 2
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    gloo = ProcessGroupGloo(prefix, rank, world_size, options)
    group = ProcessGroup(prefix, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    gloo._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    return group
