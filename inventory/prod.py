"""Example production fleet, in pyinfra's Python inventory format.

Every module-level list or ``(hosts, data)`` tuple is a group; host data beats group data.
``fleet plan inventory/prod.py`` plans it without touching a host (GPU facts come from the
``gpu`` entries until the hosts are probed). Secrets are references (``env:NAME``), never values.
"""

_ssh = {"ssh_user": "fleet", "ssh_port": 22, "ssh_strict_host_key_checking": "yes"}

_chat_workload = {
    "p95_input_tokens": 2048,
    "p95_output_tokens": 512,
    "prefix_reuse": 0.5,  # long shared system prompts
    "target_concurrency": 128,
}

# 8×H100 SXM behind NVSwitch, serving Llama-3.1-70B for chat.
h100_chat = (
    [
        ("gpu-h100-01", {**_ssh, "ssh_hostname": "gpu-h100-01.prod.internal"}),
        ("gpu-h100-02", {**_ssh, "ssh_hostname": "gpu-h100-02.prod.internal"}),
        ("gpu-h100-03", {**_ssh, "ssh_hostname": "gpu-h100-03.prod.internal", "kv_cache_dtype": "fp8"}),
    ],
    {
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "workload": _chat_workload,
        "gpu": {"sku": "h100-sxm-80gb", "count": 8, "nvlink": "switch"},
        "api_key_ref": "env:FLEET_PROD_API_KEY",
        "port": 8000,
    },
)

# 4×L40S PCIe boxes (no NVLink) serving the 8B model for batch summarisation: one instance per GPU.
l40s_batch = (
    [
        ("gpu-l40s-01", {**_ssh, "ssh_hostname": "gpu-l40s-01.prod.internal"}),
        ("gpu-l40s-02", {**_ssh, "ssh_hostname": "gpu-l40s-02.prod.internal"}),
    ],
    {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "workload": {
            "p95_input_tokens": 6144,
            "p95_output_tokens": 1024,
            "prefix_reuse": 0.1,
            "target_concurrency": 96,
        },
        "gpu": {"sku": "l40s-48gb", "count": 4},
        "api_key_ref": "env:FLEET_PROD_API_KEY",
    },
)

# A single A10 edge box with Mistral-7B.
edge = [
    (
        "edge-a10-01",
        {
            **_ssh,
            "ssh_hostname": "edge-a10-01.prod.internal",
            "model": "mistralai/Mistral-7B-Instruct-v0.3",
            "workload": {
                "p95_input_tokens": 1024,
                "p95_output_tokens": 256,
                "prefix_reuse": 0.3,
                "target_concurrency": 16,
            },
            "gpu": {"sku": "a10-24gb", "count": 1},
        },
    ),
]
