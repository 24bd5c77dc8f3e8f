/*
 * fakenvml.c - the lab's simulated GPUs at the NVML boundary.
 *
 * A shared library with the soname libnvidia-ml.so.1 that implements the part of the NVML C ABI
 * that the unmodified nvidia-ml-py (`import pynvml`) calls while fleet probes a host. It answers
 * from a per-host profile file rendered by fleetlab/profiles.py (`key=value` lines) and from the
 * live-state directory that GPU-memory holders (the vLLM stand-in) write to.
 *
 * Why a C library and not a Python mock: the probe, nvidia-ml-py and ctypes are the real parts;
 * only the driver is simulated, so struct layouts, versioned symbols and error codes are exercised
 * exactly as on a real host (pynvml resolves each C symbol by name on first use:
 * pynvml.py _nvmlGetFunctionPointer; nothing else is simulated).
 *
 * Environment:
 *   FLEET_NVML_PROFILE    profile path (default /etc/fleet-lab/nvml-profile). Missing at init
 *                         -> NVML_ERROR_DRIVER_NOT_LOADED, like a host whose driver is not running.
 *   FLEET_NVML_STATE_DIR  live-state directory (default /run/fleet-lab/nvml). A file <pid>.mem
 *                         holds lines "<nvml_index> <bytes>"; it counts while the pid is alive
 *                         (/proc/<pid> exists and is not a zombie). Re-read on every memory or
 *                         process query, so "GPU busy/free" is visible at once.
 *                         A file "events" there holds injected faults, one a line:
 *                         "<unix time> <nvml_index> xid <n>" | "... sbe" | "... dbe": an XID, a
 *                         single-bit or a double-bit ECC error on that GPU at that time. The event API
 *                         (nvmlEventSetWait_v2) delivers each one, once per event set, when its time
 *                         has come and the set registered that type on that GPU before it (NVML:
 *                         "All events that occurred before this call are not recorded"); ECC faults
 *                         that are due also count in nvmlDeviceGetTotalEccErrors.
 *
 * Fidelity: every query a real driver (580.159.04) answered on an H100 80GB HBM3 and an H200, each
 * passed through to a VM, is answered alike (tests/fixtures/gpu-truth, tests/lab/test_nvml_truth.py):
 * the same value, or the same error. Memory: v2 reserved = the driver's reserve, v2 used excludes
 * it, v1 used includes it. NVLink: NOT_SUPPORTED past the last link (and on every link of a GPU
 * passed through to a VM); only nvmlDeviceGetNvLinkCapability answers INVALID_ARGUMENT there.
 * Anything not modelled answers NVML_ERROR_NOT_SUPPORTED, as the real driver does for features a
 * board lacks; no symbol the real driver exports is left out (a missing one makes pynvml raise
 * FunctionNotFound, or NVMLLibraryMismatchError for its unversioned process-list wrappers).
 *
 * Type declarations are our own; their layouts match nvml.h (checked by _Static_assert below).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <stddef.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI subset (layouts as in nvml.h) ---------------------------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_INIT_FLAG_NO_GPUS 1u
#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24)))

typedef struct fake_device *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_v1_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v2_t) == 36, "nvmlGpuFabricInfo_v2_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 40, "nvmlGpuFabricInfo_v3_t layout");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t layout");

#define NVML_MEMORY_V2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)
#define NVML_FABRIC_V2 NVML_STRUCT_VERSION(nvmlGpuFabricInfo_v2_t, 2)
#define NVML_FABRIC_V3 NVML_STRUCT_VERSION(nvmlGpuFabricInfo_v3_t, 3)
#define NVML_TEMPERATURE_V1 NVML_STRUCT_VERSION(nvmlTemperature_v1_t, 1)

enum { NVML_VALUE_TYPE_UNSIGNED_INT = 1 };
enum {
    FI_NVLINK_LINK_COUNT = 91,
    FI_NVSWITCH_CONNECTED_LINK_COUNT = 147,
    FI_NVLINK_GET_STATE = 165,
    FI_NVLINK_GET_VERSION = 166,
};
enum { NVLINK_DEVICE_TYPE_GPU = 0, NVLINK_DEVICE_TYPE_SWITCH = 2 };
enum { NVLINK_CAP_COUNT = 6, P2P_CAPS_INDEX_COUNT = 5 };

/* ---- the simulated machine ------------------------------------------------------------- */

#define MAX_GPUS 32
#define MAX_LINKS 36
#define MAX_AFF_WORDS 16
#define MAX_LIVE 512

typedef struct {
    int present;
    int active;
    int remote_type;
    unsigned int domain, bus, device;
    unsigned int remote_device_id;
} fake_link_t;

struct fake_device {
    int configured;
    char name[96];
    char uuid[96];
    char serial[64];
    int has_serial;
    unsigned int domain, bus, device;
    unsigned int pci_device_id, pci_subsystem_id;
    unsigned int minor;
    unsigned int arch;
    int cc_major, cc_minor;
    unsigned long long mem_total, mem_reserved;
    int has_ecc, ecc_current, ecc_pending;
    unsigned long long ecc_counts[2][2]; /* [error type][counter type] */
    int has_remap;
    unsigned int remap[4]; /* correctable, uncorrectable, pending, failure */
    int has_mig, mig_current, mig_pending;
    int persistence;
    unsigned int power_limit, power_enforced, power_usage;
    int temperature;
    unsigned int pcie_cur_gen, pcie_max_gen, pcie_gpu_max_gen, pcie_cur_width, pcie_max_width;
    unsigned int nvlink_count, nvlink_version;
    fake_link_t links[MAX_LINKS];
    int has_fabric;
    unsigned int fabric_state, fabric_clique, fabric_health_mask, fabric_health_summary;
    int fabric_status;
    unsigned char cluster_uuid[16];
    unsigned int cpu_aff_words;
    unsigned long long cpu_aff[MAX_AFF_WORDS];
    int topo[MAX_GPUS];
    /* board facts (catalogue) and host facts (profile) */
    unsigned long long mem_other;     /* used by something else with nothing of ours running */
    char board_part[80], vbios[32], inforom[16];
    unsigned long long bar1_total, bar1_used;
    unsigned int clk_graphics_idle, clk_graphics_max, clk_mem_max, clk_video_idle, clk_video_max;
    unsigned int mem_clocks[8], n_mem_clocks;
    unsigned int cores, bus_width, power_min, brand, virt_mode, irq, numa_node, row_remap_banks;
    int nvlink_hidden;                /* passthrough VM: the links exist but NVML shows none */
    int conf_compute;                 /* Hopper and newer: confidential-computing capable */
    int p2p[MAX_GPUS][P2P_CAPS_INDEX_COUNT];
    unsigned long long event_types;   /* nvmlDeviceGetSupportedEventTypes */
    int event_types_set;
};

static struct fake_device g_devs[MAX_GPUS];
static unsigned int g_count;
static int g_refcount;
static char g_driver_version[80];
static char g_nvml_version[80];
static int g_cuda_version;
static int g_init_error;
static char g_driver_branch[80];

typedef struct {
    unsigned int pid;
    unsigned int gpu;
    unsigned long long bytes;
} live_entry_t;

/* ---- small helpers --------------------------------------------------------------------- */

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* Valid handle: initialized, and a pointer to one of the enumerated devices. */
static int valid_device(nvmlDevice_t d)
{
    if (g_refcount <= 0 || d == NULL)
        return 0;
    if (d < g_devs || d >= g_devs + g_count)
        return 0;
    return ((const char *)d - (const char *)g_devs) % sizeof(struct fake_device) == 0;
}

#define CHECK_INIT()                                                                                  \
    do {                                                                                              \
        if (g_refcount <= 0)                                                                          \
            return NVML_ERROR_UNINITIALIZED;                                                          \
    } while (0)

#define CHECK_DEVICE(d)                                                                               \
    do {                                                                                              \
        if (g_refcount <= 0)                                                                          \
            return NVML_ERROR_UNINITIALIZED;                                                          \
        if (!valid_device(d))                                                                         \
            return NVML_ERROR_INVALID_ARGUMENT;                                                       \
    } while (0)

#define CHECK_PTR(p)                                                                                  \
    do {                                                                                              \
        if ((p) == NULL)                                                                              \
            return NVML_ERROR_INVALID_ARGUMENT;                                                       \
    } while (0)

static unsigned int dev_index(nvmlDevice_t d)
{
    return (unsigned int)(d - g_devs);
}

static void format_bus_ids(unsigned int domain, unsigned int bus, unsigned int device, char *legacy,
                           size_t legacy_len, char *full, size_t full_len)
{
    snprintf(legacy, legacy_len, "%04X:%02X:%02X.0", domain & 0xFFFFu, bus & 0xFFu, device & 0xFFu);
    snprintf(full, full_len, "%08X:%02X:%02X.0", domain, bus & 0xFFu, device & 0xFFu);
}

/* ---- profile parsing ------------------------------------------------------------------- */

static void parse_ull_list(const char *s, unsigned long long *out, unsigned int max, unsigned int *n)
{
    char *end;
    unsigned int i = 0;
    while (i < max) {
        unsigned long long v = strtoull(s, &end, 0);
        if (end == s)
            break;
        out[i++] = v;
        s = end;
    }
    if (n != NULL)
        *n = i;
}

static void parse_int_list(const char *s, int *out, unsigned int max)
{
    char *end;
    for (unsigned int i = 0; i < max; i++) {
        long v = strtol(s, &end, 0);
        if (end == s)
            break;
        out[i] = (int)v;
        s = end;
    }
}

static void parse_hex_bytes(const char *s, unsigned char *out, unsigned int n)
{
    for (unsigned int i = 0; i < n && isxdigit((unsigned char)s[0]) && isxdigit((unsigned char)s[1]); i++) {
        char byte[3] = {s[0], s[1], 0};
        out[i] = (unsigned char)strtoul(byte, NULL, 16);
        s += 2;
    }
}

static void set_str(char *dst, size_t len, const char *value)
{
    snprintf(dst, len, "%s", value);
}

/* One "gpu.<i>.<key>=value" line. */
static void parse_gpu_key(struct fake_device *d, const char *key, const char *value)
{
    unsigned long long v[8] = {0};
    unsigned int n = 0;

    if (strncmp(key, "link.", 5) == 0) {
        unsigned int l = (unsigned int)strtoul(key + 5, NULL, 10);
        if (l >= MAX_LINKS)
            return;
        parse_ull_list(value, v, 6, &n);
        if (n < 5)
            return;
        d->links[l] = (fake_link_t){1, (int)v[0], (int)v[1], (unsigned)v[2], (unsigned)v[3], (unsigned)v[4],
                                    (unsigned)v[5]};
        return;
    }
    if (strcmp(key, "p2p") == 0) {
        parse_int_list(value, &d->p2p[0][0], MAX_GPUS * P2P_CAPS_INDEX_COUNT);
        return;
    }
    if (strcmp(key, "topo") == 0) {
        parse_int_list(value, d->topo, MAX_GPUS);
        return;
    }
    if (strcmp(key, "name") == 0) {
        set_str(d->name, sizeof d->name, value);
        return;
    }
    if (strcmp(key, "board_part_number") == 0) {
        set_str(d->board_part, sizeof d->board_part, value);
        return;
    }
    if (strcmp(key, "vbios") == 0) {
        set_str(d->vbios, sizeof d->vbios, value);
        return;
    }
    if (strcmp(key, "inforom") == 0) {
        set_str(d->inforom, sizeof d->inforom, value);
        return;
    }
    if (strcmp(key, "uuid") == 0) {
        set_str(d->uuid, sizeof d->uuid, value);
        return;
    }
    if (strcmp(key, "serial") == 0) {
        set_str(d->serial, sizeof d->serial, value);
        d->has_serial = 1;
        return;
    }
    if (strcmp(key, "fabric") == 0) {
        /* state status clique health_mask health_summary cluster_uuid_hex */
        char *end;
        const char *s = value;
        parse_ull_list(s, v, 5, &n);
        if (n < 5)
            return;
        for (int i = 0; i < 5; i++) {
            strtoull(s, &end, 0);
            s = end;
        }
        while (*s == ' ')
            s++;
        d->has_fabric = 1;
        d->fabric_state = (unsigned)v[0];
        d->fabric_status = (int)v[1];
        d->fabric_clique = (unsigned)v[2];
        d->fabric_health_mask = (unsigned)v[3];
        d->fabric_health_summary = (unsigned)v[4];
        parse_hex_bytes(s, d->cluster_uuid, 16);
        return;
    }
    if (strcmp(key, "cpu_affinity") == 0) {
        parse_ull_list(value, d->cpu_aff, MAX_AFF_WORDS, &d->cpu_aff_words);
        return;
    }

    parse_ull_list(value, v, 8, &n);
    if (n == 0)
        return;
    if (strcmp(key, "pci") == 0 && n >= 3) {
        d->domain = (unsigned)v[0];
        d->bus = (unsigned)v[1];
        d->device = (unsigned)v[2];
    } else if (strcmp(key, "pci_device_id") == 0) {
        d->pci_device_id = (unsigned)v[0];
    } else if (strcmp(key, "pci_subsystem_id") == 0) {
        d->pci_subsystem_id = (unsigned)v[0];
    } else if (strcmp(key, "minor") == 0) {
        d->minor = (unsigned)v[0];
    } else if (strcmp(key, "arch") == 0) {
        d->arch = (unsigned)v[0];
    } else if (strcmp(key, "cc") == 0 && n >= 2) {
        d->cc_major = (int)v[0];
        d->cc_minor = (int)v[1];
    } else if (strcmp(key, "memory") == 0 && n >= 2) {
        d->mem_total = v[0];
        d->mem_reserved = v[1];
        d->mem_other = n >= 3 ? v[2] : 0;
    } else if (strcmp(key, "bar1") == 0 && n >= 2) {
        d->bar1_total = v[0];
        d->bar1_used = v[1];
    } else if (strcmp(key, "clocks") == 0 && n >= 5) {
        d->clk_graphics_idle = (unsigned)v[0];
        d->clk_graphics_max = (unsigned)v[1];
        d->clk_mem_max = (unsigned)v[2];
        d->clk_video_idle = (unsigned)v[3];
        d->clk_video_max = (unsigned)v[4];
    } else if (strcmp(key, "mem_clocks") == 0) {
        d->n_mem_clocks = n > 8 ? 8 : n;
        for (unsigned int i = 0; i < d->n_mem_clocks; i++)
            d->mem_clocks[i] = (unsigned)v[i];
    } else if (strcmp(key, "row_remap_banks") == 0) {
        d->row_remap_banks = (unsigned)v[0];
    } else if (strcmp(key, "cores") == 0) {
        d->cores = (unsigned)v[0];
    } else if (strcmp(key, "bus_width") == 0) {
        d->bus_width = (unsigned)v[0];
    } else if (strcmp(key, "power_min") == 0) {
        d->power_min = (unsigned)v[0];
    } else if (strcmp(key, "brand") == 0) {
        d->brand = (unsigned)v[0];
    } else if (strcmp(key, "virtualization") == 0) {
        d->virt_mode = (unsigned)v[0];
    } else if (strcmp(key, "irq") == 0) {
        d->irq = (unsigned)v[0];
    } else if (strcmp(key, "numa_node") == 0) {
        d->numa_node = (unsigned)v[0];
    } else if (strcmp(key, "nvlink_hidden") == 0) {
        d->nvlink_hidden = (int)v[0];
    } else if (strcmp(key, "event_types") == 0) {
        d->event_types = v[0];
        d->event_types_set = 1;
    } else if (strcmp(key, "conf_compute") == 0) {
        d->conf_compute = (int)v[0];
    } else if (strcmp(key, "ecc") == 0 && n >= 6) {
        d->has_ecc = 1;
        d->ecc_current = (int)v[0];
        d->ecc_pending = (int)v[1];
        d->ecc_counts[0][0] = v[2];
        d->ecc_counts[0][1] = v[3];
        d->ecc_counts[1][0] = v[4];
        d->ecc_counts[1][1] = v[5];
    } else if (strcmp(key, "remapped_rows") == 0 && n >= 4) {
        d->has_remap = 1;
        for (int i = 0; i < 4; i++)
            d->remap[i] = (unsigned)v[i];
    } else if (strcmp(key, "mig") == 0 && n >= 2) {
        d->has_mig = 1;
        d->mig_current = (int)v[0];
        d->mig_pending = (int)v[1];
    } else if (strcmp(key, "persistence") == 0) {
        d->persistence = (int)v[0];
    } else if (strcmp(key, "power") == 0 && n >= 3) {
        d->power_limit = (unsigned)v[0];
        d->power_enforced = (unsigned)v[1];
        d->power_usage = (unsigned)v[2];
    } else if (strcmp(key, "temperature") == 0) {
        d->temperature = (int)v[0];
    } else if (strcmp(key, "pcie") == 0 && n >= 5) {
        d->pcie_cur_gen = (unsigned)v[0];
        d->pcie_max_gen = (unsigned)v[1];
        d->pcie_gpu_max_gen = (unsigned)v[2];
        d->pcie_cur_width = (unsigned)v[3];
        d->pcie_max_width = (unsigned)v[4];
    } else if (strcmp(key, "nvlink") == 0 && n >= 2) {
        d->nvlink_count = (unsigned)(v[0] > MAX_LINKS ? MAX_LINKS : v[0]);
        d->nvlink_version = (unsigned)v[1];
    }
}

static void parse_line(char *line)
{
    char *eq = strchr(line, '=');
    if (line[0] == '#' || eq == NULL)
        return;
    *eq = '\0';
    const char *key = line;
    const char *value = eq + 1;

    if (strncmp(key, "gpu.", 4) == 0) {
        char *end;
        unsigned long i = strtoul(key + 4, &end, 10);
        if (end == key + 4 || *end != '.' || i >= MAX_GPUS)
            return;
        g_devs[i].configured = 1;
        parse_gpu_key(&g_devs[i], end + 1, value);
    } else if (strcmp(key, "driver_version") == 0) {
        set_str(g_driver_version, sizeof g_driver_version, value);
    } else if (strcmp(key, "nvml_version") == 0) {
        set_str(g_nvml_version, sizeof g_nvml_version, value);
    } else if (strcmp(key, "cuda_driver_version") == 0) {
        g_cuda_version = atoi(value);
    } else if (strcmp(key, "driver_branch") == 0) {
        set_str(g_driver_branch, sizeof g_driver_branch, value);
    } else if (strcmp(key, "init_error") == 0) {
        g_init_error = atoi(value);
    } else if (strcmp(key, "gpu_count") == 0) {
        long n = strtol(value, NULL, 10);
        g_count = (unsigned int)(n < 0 ? 0 : (n > MAX_GPUS ? MAX_GPUS : n));
    }
}

static const char *profile_path(void)
{
    const char *p = getenv("FLEET_NVML_PROFILE");
    return (p != NULL && p[0] != '\0') ? p : "/etc/fleet-lab/nvml-profile";
}

static const char *state_dir(void)
{
    const char *p = getenv("FLEET_NVML_STATE_DIR");
    return (p != NULL && p[0] != '\0') ? p : "/run/fleet-lab/nvml";
}

/* Load the profile into the device table; NVML_ERROR_DRIVER_NOT_LOADED if it cannot be read. */
/* The profile file this process initialised against (device, inode and change time: an inode
 * number can be reused by the file that replaces it). */
static dev_t g_profile_dev;
static ino_t g_profile_ino;
static struct timespec g_profile_ctime;

static nvmlReturn_t load_profile(void)
{
    FILE *f = fopen(profile_path(), "r");
    char line[8192];
    struct stat st;

    if (f == NULL)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (fstat(fileno(f), &st) == 0) {
        g_profile_dev = st.st_dev;
        g_profile_ino = st.st_ino;
        g_profile_ctime = st.st_ctim;
    }
    memset(g_devs, 0, sizeof g_devs);
    g_count = 0;
    g_cuda_version = 0;
    g_init_error = 0;
    g_driver_version[0] = g_nvml_version[0] = g_driver_branch[0] = '\0';
    while (fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        parse_line(line);
    }
    fclose(f);
    for (unsigned int i = 0; i < g_count; i++)
        if (!g_devs[i].configured)
            return NVML_ERROR_UNKNOWN; /* a profile naming fewer GPUs than gpu_count is corrupt */
    return NVML_SUCCESS;
}

/* ---- live state ------------------------------------------------------------------------ */

/* A pid counts while /proc/<pid>/stat exists and its state is not zombie/dead. */
static int pid_alive(unsigned int pid)
{
    char path[64], buf[512];
    FILE *f;
    size_t n;
    char *paren;

    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    f = fopen(path, "r");
    if (f == NULL)
        return 0;
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    paren = strrchr(buf, ')');
    if (paren == NULL || paren[1] != ' ')
        return 0;
    return paren[2] != 'Z' && paren[2] != 'X' && paren[2] != 'x';
}

/* Parse "<digits>.mem" into a pid; 0 if the name does not match. */
static unsigned int pid_from_name(const char *name)
{
    char *end;
    unsigned long pid;

    if (!isdigit((unsigned char)name[0]))
        return 0;
    pid = strtoul(name, &end, 10);
    if (strcmp(end, ".mem") != 0 || pid == 0 || pid > 0xFFFFFFFFul)
        return 0;
    return (unsigned int)pid;
}

static unsigned int read_mem_file(const char *dir, const char *name, unsigned int pid, live_entry_t *out,
                                  unsigned int room)
{
    char path[4096], line[256];
    unsigned int n = 0;
    FILE *f;

    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "r");
    if (f == NULL)
        return 0;
    while (n < room && fgets(line, sizeof line, f) != NULL) {
        unsigned int gpu;
        unsigned long long bytes;
        if (sscanf(line, "%u %llu", &gpu, &bytes) != 2 || gpu >= g_count)
            continue;
        out[n++] = (live_entry_t){pid, gpu, bytes};
    }
    fclose(f);
    return n;
}

/* Every (pid, gpu, bytes) held by a live process right now. */
static unsigned int scan_live(live_entry_t *out, unsigned int room)
{
    const char *dir = state_dir();
    DIR *dp = opendir(dir);
    struct dirent *e;
    unsigned int n = 0;

    if (dp == NULL)
        return 0;
    while (n < room && (e = readdir(dp)) != NULL) {
        unsigned int pid = pid_from_name(e->d_name);
        if (pid != 0 && pid_alive(pid))
            n += read_mem_file(dir, e->d_name, pid, out + n, room - n);
    }
    closedir(dp);
    return n;
}

/* Per-process totals on one GPU (one entry per pid), returns the count. */
static unsigned int live_processes(unsigned int gpu, nvmlProcessInfo_v2_t *procs, unsigned int room)
{
    static live_entry_t live[MAX_LIVE];
    unsigned int n = scan_live(live, MAX_LIVE), count = 0;

    for (unsigned int i = 0; i < n; i++) {
        unsigned int j;
        if (live[i].gpu != gpu)
            continue;
        for (j = 0; j < count && procs[j].pid != live[i].pid; j++)
            ;
        if (j == count) {
            if (count == room)
                continue;
            procs[count++] = (nvmlProcessInfo_v2_t){live[i].pid, 0, 0xFFFFFFFFu, 0xFFFFFFFFu};
        }
        procs[j].usedGpuMemory += live[i].bytes;
    }
    return count;
}

static unsigned long long live_bytes(unsigned int gpu)
{
    static nvmlProcessInfo_v2_t procs[MAX_LIVE];
    unsigned int n = live_processes(gpu, procs, MAX_LIVE);
    unsigned long long total = 0;
    for (unsigned int i = 0; i < n; i++)
        total += procs[i].usedGpuMemory;
    return total;
}

/*
 * Memory like the real driver (nvml.h nvmlMemory_v2_t; measured on H100/H200, driver 580):
 * v2 reserved = the driver/firmware reserve; v2 used = what processes (and anything else) hold,
 * excluding the reserve; v1 used = reserve + v2 used; reserved + used + free = total.
 */
static void memory_now(const struct fake_device *d, unsigned long long *used_v2, unsigned long long *free_)
{
    unsigned long long held = d->mem_other + live_bytes(dev_index((nvmlDevice_t)d));
    if (held > d->mem_total - d->mem_reserved)
        held = d->mem_total - d->mem_reserved;
    *used_v2 = held;
    *free_ = d->mem_total - d->mem_reserved - held;
}

/* ---- init, errors, system -------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    if (g_refcount > 0) {
        g_refcount++;
        return NVML_SUCCESS;
    }
    nvmlReturn_t r = load_profile();
    if (r != NVML_SUCCESS)
        return r;
    if (g_init_error != 0)
        return g_init_error;
    if (g_count == 0 && !(flags & NVML_INIT_FLAG_NO_GPUS))
        return NVML_ERROR_GPU_NOT_FOUND;
    g_refcount = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

EXPORT nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    CHECK_INIT();
    g_refcount--;
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    return copy_string(version, length, g_driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    CHECK_INIT();
    return copy_string(version, length, g_nvml_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    CHECK_INIT();
    CHECK_PTR(cudaDriverVersion);
    *cudaDriverVersion = g_cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- enumeration and identity ---------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    CHECK_INIT();
    CHECK_PTR(deviceCount);
    *deviceCount = g_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    CHECK_INIT();
    CHECK_PTR(device);
    if (index >= g_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devs[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    CHECK_INIT();
    CHECK_PTR(uuid);
    CHECK_PTR(device);
    for (unsigned int i = 0; i < g_count; i++) {
        if (strcmp(g_devs[i].uuid, uuid) == 0) {
            *device = &g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device)
{
    CHECK_INIT();
    CHECK_PTR(serial);
    CHECK_PTR(device);
    for (unsigned int i = 0; i < g_count; i++) {
        if (g_devs[i].has_serial && strcmp(g_devs[i].serial, serial) == 0) {
            *device = &g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Accepts "dddddddd:bb:dd.f", "dddd:bb:dd.f" and "bb:dd.f", any case. */
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    unsigned int domain = 0, bus, dev, fn;
    CHECK_INIT();
    CHECK_PTR(pciBusId);
    CHECK_PTR(device);
    if (sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4) {
        domain = 0;
        if (sscanf(pciBusId, "%x:%x.%x", &bus, &dev, &fn) != 3)
            return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (unsigned int i = 0; i < g_count; i++) {
        const struct fake_device *d = &g_devs[i];
        if (d->domain == domain && d->bus == bus && d->device == dev && fn == 0) {
            *device = &g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    CHECK_DEVICE(device);
    return copy_string(name, length, device->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    CHECK_DEVICE(device);
    return copy_string(uuid, length, device->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    CHECK_DEVICE(device);
    if (!device->has_serial)
        return NVML_ERROR_NOT_SUPPORTED;
    return copy_string(serial, length, device->serial);
}

static void fill_pci(nvmlPciInfo_t *pci, unsigned int domain, unsigned int bus, unsigned int dev,
                     unsigned int device_id, unsigned int subsystem_id)
{
    memset(pci, 0, sizeof *pci);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = device_id;
    pci->pciSubSystemId = subsystem_id;
    format_bus_ids(domain, bus, dev, pci->busIdLegacy, sizeof pci->busIdLegacy, pci->busId,
                   sizeof pci->busId);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    CHECK_DEVICE(device);
    CHECK_PTR(pci);
    fill_pci(pci, device->domain, device->bus, device->device, device->pci_device_id,
             device->pci_subsystem_id);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    CHECK_DEVICE(device);
    CHECK_PTR(index);
    *index = dev_index(device);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    CHECK_DEVICE(device);
    CHECK_PTR(minorNumber);
    *minorNumber = device->minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    CHECK_DEVICE(device);
    CHECK_PTR(arch);
    *arch = device->arch;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    CHECK_DEVICE(device);
    CHECK_PTR(major);
    CHECK_PTR(minor);
    *major = device->cc_major;
    *minor = device->cc_minor;
    return NVML_SUCCESS;
}

/* ---- memory and processes -------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    CHECK_DEVICE(device);
    CHECK_PTR(memory);
    memory->total = device->mem_total;
    memory_now(device, &memory->used, &memory->free);
    memory->used += device->mem_reserved; /* v1: "used = Sum of Reserved and Allocated" (nvml.h) */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    CHECK_DEVICE(device);
    CHECK_PTR(memory);
    if (memory->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device->mem_total;
    memory->reserved = device->mem_reserved;
    memory_now(device, &memory->used, &memory->free);
    return NVML_SUCCESS;
}

/*
 * Two-phase process listing shared by all versions: with too small a buffer (or NULL) report the
 * needed count and NVML_ERROR_INSUFFICIENT_SIZE; SUCCESS with count 0 when nothing runs.
 */
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                                      size_t entry_size)
{
    static nvmlProcessInfo_v2_t procs[MAX_LIVE];
    unsigned int n;

    CHECK_DEVICE(device);
    CHECK_PTR(infoCount);
    n = live_processes(dev_index(device), procs, MAX_LIVE);
    if (n == 0) {
        *infoCount = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *infoCount < n) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        char *slot = (char *)infos + i * entry_size;
        if (entry_size == sizeof(nvmlProcessInfo_v1_t))
            *(nvmlProcessInfo_v1_t *)slot = (nvmlProcessInfo_v1_t){procs[i].pid, procs[i].usedGpuMemory};
        else
            *(nvmlProcessInfo_v2_t *)slot = procs[i];
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos)
{
    return running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v2_t));
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos)
{
    return running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v2_t));
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    return running_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v1_t));
}

/* Headless servers run no graphics clients. */
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v2_t *infos)
{
    (void)infos;
    CHECK_DEVICE(device);
    CHECK_PTR(infoCount);
    *infoCount = 0;
    return NVML_SUCCESS;
}

/* ---- ECC, remapping, MIG, persistence, power, temperature ------------------------------- */

static unsigned long long due_ecc_faults(unsigned int gpu, unsigned long long type);

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending)
{
    CHECK_DEVICE(device);
    CHECK_PTR(current);
    CHECK_PTR(pending);
    if (!device->has_ecc)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = device->ecc_current;
    *pending = device->ecc_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                                unsigned long long *eccCounts)
{
    CHECK_DEVICE(device);
    CHECK_PTR(eccCounts);
    if (errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->has_ecc || !device->ecc_current)
        return NVML_ERROR_NOT_SUPPORTED;
    /* an injected fault that is due counts in both the volatile and the aggregate counter */
    *eccCounts = device->ecc_counts[errorType][counterType] +
                 due_ecc_faults(dev_index(device), errorType == 0 ? 0x1ull : 0x2ull);
    return NVML_SUCCESS;
}

/* Ampere and newer replaced page retirement by row remapping: page queries are not supported. */
static nvmlReturn_t retired_pages_support(nvmlDevice_t device)
{
    CHECK_DEVICE(device);
    if (!device->has_ecc || device->has_remap || device->arch >= 7)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                              unsigned long long *addresses)
{
    nvmlReturn_t r = retired_pages_support(device);
    (void)cause;
    (void)addresses;
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(pageCount);
    *pageCount = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned int *pageCount,
                                                 unsigned long long *addresses, unsigned long long *timestamps)
{
    (void)timestamps;
    return nvmlDeviceGetRetiredPages(device, cause, pageCount, addresses);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending)
{
    nvmlReturn_t r = retired_pages_support(device);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(isPending);
    *isPending = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred)
{
    CHECK_DEVICE(device);
    CHECK_PTR(corrRows);
    CHECK_PTR(uncRows);
    CHECK_PTR(isPending);
    CHECK_PTR(failureOccurred);
    if (!device->has_remap)
        return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = device->remap[0];
    *uncRows = device->remap[1];
    *isPending = device->remap[2];
    *failureOccurred = device->remap[3];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode)
{
    CHECK_DEVICE(device);
    CHECK_PTR(currentMode);
    CHECK_PTR(pendingMode);
    if (!device->has_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = (unsigned)device->mig_current;
    *pendingMode = (unsigned)device->mig_pending;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode)
{
    CHECK_DEVICE(device);
    CHECK_PTR(mode);
    *mode = device->persistence;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    CHECK_DEVICE(device);
    CHECK_PTR(limit);
    *limit = device->power_limit;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *limit)
{
    return nvmlDeviceGetPowerManagementLimit(device, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    CHECK_DEVICE(device);
    CHECK_PTR(limit);
    *limit = device->power_enforced;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    CHECK_DEVICE(device);
    CHECK_PTR(power);
    *power = device->power_usage;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    CHECK_DEVICE(device);
    CHECK_PTR(temp);
    if (sensorType != 0) /* NVML_TEMPERATURE_GPU is the only sensor */
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)device->temperature;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temperature)
{
    CHECK_DEVICE(device);
    CHECK_PTR(temperature);
    if (temperature->version != NVML_TEMPERATURE_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    temperature->temperature = device->temperature;
    return NVML_SUCCESS;
}

/* ---- PCIe ------------------------------------------------------------------------------ */

static nvmlReturn_t pcie_value(nvmlDevice_t device, unsigned int *out, unsigned int value)
{
    CHECK_DEVICE(device);
    CHECK_PTR(out);
    *out = value;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_value(device, gen, valid_device(device) ? device->pcie_cur_gen : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_value(device, gen, valid_device(device) ? device->pcie_max_gen : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *gen)
{
    return pcie_value(device, gen, valid_device(device) ? device->pcie_gpu_max_gen : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *width)
{
    return pcie_value(device, width, valid_device(device) ? device->pcie_cur_width : 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *width)
{
    return pcie_value(device, width, valid_device(device) ? device->pcie_max_width : 0);
}

/* ---- topology, P2P, NUMA --------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                        int *pathInfo)
{
    CHECK_DEVICE(device1);
    CHECK_DEVICE(device2);
    CHECK_PTR(pathInfo);
    if (device1 == device2) /* a real driver (580, H100/H200) answers NOT_SUPPORTED for (h, h) */
        return NVML_ERROR_NOT_SUPPORTED;
    *pathInfo = device1->topo[dev_index(device2)];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int p2pIndex,
                                           int *p2pStatus)
{
    CHECK_DEVICE(device1);
    CHECK_DEVICE(device2);
    CHECK_PTR(p2pStatus);
    if (p2pIndex < 0 || p2pIndex >= P2P_CAPS_INDEX_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *p2pStatus = device1->p2p[dev_index(device2)][p2pIndex];
    return NVML_SUCCESS;
}

/* GPU memory is not a NUMA node on x86 hosts (nvidia-smi prints "GPU NUMA ID N/A"). */
EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    CHECK_DEVICE(device);
    CHECK_PTR(node);
    return NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                             unsigned long *cpuSet)
{
    CHECK_DEVICE(device);
    if (cpuSetSize == 0 || cpuSet == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->cpu_aff_words == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    for (unsigned int i = 0; i < cpuSetSize; i++)
        cpuSet[i] = i < device->cpu_aff_words ? (unsigned long)device->cpu_aff[i] : 0;
    return NVML_SUCCESS;
}

/* ---- NVLink ---------------------------------------------------------------------------- */

/*
 * What the real driver (580, H100/H200 passed through to a VM) answers: NOT_SUPPORTED for state,
 * version, remote PCI info and remote type on every link when NVLink is not visible, and past the
 * last link; nvmlDeviceGetNvLinkCapability validates the link index first (INVALID_ARGUMENT past
 * the last link, see capability_link below).
 */
static nvmlReturn_t check_link(nvmlDevice_t device, unsigned int link)
{
    CHECK_DEVICE(device);
    if (device->nvlink_count == 0 || device->nvlink_hidden)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= device->nvlink_count || !device->links[link].present)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

/* NVML_NVLINK_MAX_LINKS (nvml.h): 18 */
#define NVLINK_MAX_LINKS 18u

static nvmlReturn_t capability_link(nvmlDevice_t device, unsigned int link)
{
    CHECK_DEVICE(device);
    if (device->nvlink_count == 0 && !device->nvlink_hidden)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (device->nvlink_count ? device->nvlink_count : NVLINK_MAX_LINKS))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device->nvlink_hidden)
        return NVML_ERROR_NOT_SUPPORTED;
    return check_link(device, link);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive)
{
    nvmlReturn_t r = check_link(device, link);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(isActive);
    *isActive = device->links[link].active ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version)
{
    nvmlReturn_t r = check_link(device, link);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(version);
    *version = device->nvlink_version;
    return NVML_SUCCESS;
}

/* P2P, sysmem access and P2P atomics over every link; no sysmem atomics on x86; no SLI bridge. */
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link, int capability,
                                                  unsigned int *capResult)
{
    static const unsigned int caps[NVLINK_CAP_COUNT] = {1, 1, 1, 0, 0, 1};
    nvmlReturn_t r = capability_link(device, link);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(capResult);
    if (capability < 0 || capability >= NVLINK_CAP_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    *capResult = caps[capability];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                        nvmlPciInfo_t *pci)
{
    nvmlReturn_t r = check_link(device, link);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(pci);
    const fake_link_t *l = &device->links[link];
    /* "pciSubSystemId is not filled" (nvml.h) */
    fill_pci(pci, l->domain, l->bus, l->device, l->remote_device_id, 0);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
                                                     nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                        int *remoteType)
{
    nvmlReturn_t r = check_link(device, link);
    if (r != NVML_SUCCESS)
        return r;
    CHECK_PTR(remoteType);
    *remoteType = device->links[link].remote_type;
    return NVML_SUCCESS;
}

static unsigned int active_switch_links(nvmlDevice_t device)
{
    unsigned int n = 0;
    for (unsigned int l = 0; l < device->nvlink_count; l++)
        if (device->links[l].active && device->links[l].remote_type == NVLINK_DEVICE_TYPE_SWITCH)
            n++;
    return n;
}

static void field_value(nvmlDevice_t device, nvmlFieldValue_t *v)
{
    v->timestamp = 0;
    v->latencyUsec = 0;
    v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
    v->value.ullVal = 0;
    v->nvmlReturn = NVML_SUCCESS;
    switch (v->fieldId) {
    case FI_NVLINK_LINK_COUNT:
    case FI_NVSWITCH_CONNECTED_LINK_COUNT:
        if (device->nvlink_count == 0 || device->nvlink_hidden)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else if (v->fieldId == FI_NVLINK_LINK_COUNT)
            v->value.uiVal = device->nvlink_count;
        else
            v->value.uiVal = active_switch_links(device);
        return;
    case FI_NVLINK_GET_STATE:
    case FI_NVLINK_GET_VERSION:
        v->nvmlReturn = check_link(device, v->scopeId);
        if (v->nvmlReturn == NVML_SUCCESS)
            v->value.uiVal = v->fieldId == FI_NVLINK_GET_STATE ? (unsigned)device->links[v->scopeId].active
                                                               : device->nvlink_version;
        return;
    default:
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    CHECK_DEVICE(device);
    if (valuesCount < 0 || (valuesCount > 0 && values == NULL))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < valuesCount; i++)
        field_value(device, &values[i]);
    return NVML_SUCCESS;
}

/* ---- GPU fabric (Hopper SXM and newer) ------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v3_t *info)
{
    CHECK_DEVICE(device);
    CHECK_PTR(info);
    if (info->version != NVML_FABRIC_V2 && info->version != NVML_FABRIC_V3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!device->has_fabric)
        return NVML_ERROR_NOT_SUPPORTED;
    memcpy(info->clusterUuid, device->cluster_uuid, sizeof info->clusterUuid);
    info->status = device->fabric_status;
    info->cliqueId = device->fabric_clique;
    info->state = (unsigned char)device->fabric_state;
    info->healthMask = device->fabric_health_mask;
    if (info->version == NVML_FABRIC_V3)
        info->healthSummary = (unsigned char)device->fabric_health_summary;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    CHECK_DEVICE(device);
    CHECK_PTR(info);
    if (!device->has_fabric)
        return NVML_ERROR_NOT_SUPPORTED;
    memcpy(info->clusterUuid, device->cluster_uuid, sizeof info->clusterUuid);
    info->status = device->fabric_status;
    info->cliqueId = device->fabric_clique;
    info->state = (unsigned char)device->fabric_state;
    return NVML_SUCCESS;
}

/* ---- events (nvml.h "Event Handling Methods") ------------------------------------------------
 *
 * Faults are lines of <state dir>/events, "<unix time> <nvml index> xid <n>|sbe|dbe", written by
 * the lab (fleetlab.nvml.faults). Each event set delivers each due fault once, in time order, for
 * the types it registered on that GPU before the fault's time. Return codes are those the NVML API
 * reference gives for each function; nvmlEventSetWait_v2 answers NVML_ERROR_UNKNOWN ("any
 * unexpected error") once the driver it was initialised against is gone or replaced (the profile
 * file removed or written anew), which is how the lab reloads a driver under a running watcher.
 */

typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");

enum {
    EVENT_SINGLE_BIT_ECC = 0x1,
    EVENT_DOUBLE_BIT_ECC = 0x2,
    EVENT_XID_CRITICAL = 0x8,
};
/* nvmlEventTypeAll (pynvml 13.615): every event bit NVML defines. */
#define EVENT_TYPE_ALL 0xFF9Full
/* What a real H100/H200 (driver 580) answered to nvmlDeviceGetSupportedEventTypes. */
#define EVENT_TYPES_RECORDED 0xFF9Full
#define EVENT_BITS 16
#define MAX_EVENT_SETS 32
#define MAX_FAULTS 4096
#define NO_INSTANCE 0xFFFFFFFFu

typedef struct {
    double at;
    unsigned int gpu;
    unsigned long long type;
    unsigned long long data;
} fault_t;

struct fake_event_set {
    int used;
    double registered_at[MAX_GPUS][EVENT_BITS]; /* 0: that type is not registered on that GPU */
    unsigned char delivered[MAX_FAULTS];
};

static struct fake_event_set g_sets[MAX_EVENT_SETS];
static fault_t g_faults[MAX_FAULTS];
static unsigned int g_nfaults;
static struct stat g_faults_stat;
static int g_faults_loaded;

static double now_realtime(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int valid_set(nvmlEventSet_t set)
{
    if (set == NULL || set < g_sets || set >= g_sets + MAX_EVENT_SETS)
        return 0;
    if (((const char *)set - (const char *)g_sets) % sizeof(struct fake_event_set) != 0)
        return 0;
    return set->used;
}

static int bit_index(unsigned long long type)
{
    for (int i = 0; i < EVENT_BITS; i++)
        if (type == (1ull << i))
            return i;
    return -1;
}

/* One fault line; 0 if malformed (the line still takes its index, so indices stay stable). */
static int parse_fault(const char *line, fault_t *out)
{
    double at;
    unsigned int gpu;
    char kind[8];
    unsigned long long data = 0;
    int n = sscanf(line, "%lf %u %7s %llu", &at, &gpu, kind, &data);

    if (n < 3 || gpu >= MAX_GPUS)
        return 0;
    if (strcmp(kind, "xid") == 0 && n == 4) {
        *out = (fault_t){at, gpu, EVENT_XID_CRITICAL, data};
    } else if (strcmp(kind, "sbe") == 0) {
        *out = (fault_t){at, gpu, EVENT_SINGLE_BIT_ECC, 0};
    } else if (strcmp(kind, "dbe") == 0) {
        *out = (fault_t){at, gpu, EVENT_DOUBLE_BIT_ECC, 0};
    } else {
        return 0;
    }
    return 1;
}

/* Re-read the fault file when it changed (inode, size or mtime); keep the old list otherwise. */
static void load_faults(void)
{
    char path[4096], line[256];
    struct stat st;
    FILE *f;

    snprintf(path, sizeof path, "%s/events", state_dir());
    if (stat(path, &st) != 0) {
        g_nfaults = 0;
        g_faults_loaded = 0;
        return;
    }
    if (g_faults_loaded && st.st_ino == g_faults_stat.st_ino && st.st_size == g_faults_stat.st_size &&
        st.st_mtim.tv_sec == g_faults_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_faults_stat.st_mtim.tv_nsec)
        return;
    f = fopen(path, "r");
    if (f == NULL)
        return;
    g_nfaults = 0;
    while (g_nfaults < MAX_FAULTS && fgets(line, sizeof line, f) != NULL) {
        if (!parse_fault(line, &g_faults[g_nfaults]))
            g_faults[g_nfaults] = (fault_t){0, MAX_GPUS, 0, 0}; /* never deliverable */
        g_nfaults++;
    }
    fclose(f);
    g_faults_stat = st;
    g_faults_loaded = 1;
}

/* Due ECC faults of one type on one GPU: they count like the driver's volatile counters. */
static unsigned long long due_ecc_faults(unsigned int gpu, unsigned long long type)
{
    double now = now_realtime();
    unsigned long long n = 0;

    load_faults();
    for (unsigned int i = 0; i < g_nfaults; i++)
        if (g_faults[i].gpu == gpu && g_faults[i].type == type && g_faults[i].at <= now)
            n++;
    return n;
}

static unsigned long long supported_events(nvmlDevice_t device)
{
    unsigned long long types = device->event_types_set ? device->event_types : EVENT_TYPES_RECORDED;
    /* "ECC events are available only on ECC enabled devices" (nvmlDeviceRegisterEvents) */
    if (!device->has_ecc || !device->ecc_current)
        types &= ~(unsigned long long)(EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC);
    return types;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types)
{
    CHECK_DEVICE(device);
    CHECK_PTR(types);
    *types = supported_events(device);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    CHECK_INIT();
    CHECK_PTR(set);
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!g_sets[i].used) {
            memset(&g_sets[i], 0, sizeof g_sets[i]);
            g_sets[i].used = 1;
            *set = &g_sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_UNKNOWN;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    CHECK_INIT();
    if (!valid_set(set))
        return NVML_ERROR_UNKNOWN;
    set->used = 0;
    return NVML_SUCCESS;
}

/*
 * "If function reports NVML_ERROR_NOT_SUPPORTED, event set can still be used. None of the
 * requested eventTypes are registered in that case." Unknown bits are INVALID_ARGUMENT.
 */
EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set)
{
    double now = now_realtime();

    CHECK_DEVICE(device);
    if (!valid_set(set) || (eventTypes & ~EVENT_TYPE_ALL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((eventTypes & ~supported_events(device)) != 0)
        return NVML_ERROR_NOT_SUPPORTED;
    for (int b = 0; b < EVENT_BITS; b++)
        if ((eventTypes & (1ull << b)) && set->registered_at[dev_index(device)][b] == 0)
            set->registered_at[dev_index(device)][b] = now;
    return NVML_SUCCESS;
}

/* The driver this process initialised against is still the one loaded. */
static int same_driver(void)
{
    struct stat st;
    return stat(profile_path(), &st) == 0 && st.st_dev == g_profile_dev && st.st_ino == g_profile_ino &&
           st.st_ctim.tv_sec == g_profile_ctime.tv_sec && st.st_ctim.tv_nsec == g_profile_ctime.tv_nsec;
}

/* The earliest due, undelivered fault this set registered for; -1 if none. *next: the earliest
 * registered fault still to come (or 0). */
static int next_fault(nvmlEventSet_t set, double now, double *next)
{
    int best = -1;

    *next = 0;
    for (unsigned int i = 0; i < g_nfaults; i++) {
        const fault_t *f = &g_faults[i];
        int b = bit_index(f->type);
        double since;
        if (b < 0 || f->gpu >= g_count || set->delivered[i])
            continue;
        since = set->registered_at[f->gpu][b];
        if (since == 0 || f->at < since)
            continue;
        if (f->at > now) {
            if (*next == 0 || f->at < *next)
                *next = f->at;
            continue;
        }
        if (best < 0 || f->at < g_faults[best].at)
            best = (int)i;
    }
    return best;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    double deadline = now_realtime() + timeoutms / 1000.0;

    CHECK_INIT();
    if (!valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    CHECK_PTR(data);
    for (;;) {
        double now = now_realtime(), next, nap;
        int i;
        if (!same_driver())
            return NVML_ERROR_UNKNOWN;
        load_faults();
        i = next_fault(set, now, &next);
        if (i >= 0) {
            const fault_t *f = &g_faults[i];
            set->delivered[i] = 1;
            data->device = &g_devs[f->gpu];
            data->eventType = f->type;
            /* "eventData: Stores XID error for the device in the event of
             * nvmlEventTypeXidCriticalError, eventData is 0 for any other event." */
            data->eventData = f->type == EVENT_XID_CRITICAL ? f->data : 0;
            data->gpuInstanceId = NO_INSTANCE;
            data->computeInstanceId = NO_INSTANCE;
            return NVML_SUCCESS;
        }
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        nap = deadline - now;
        if (nap > 0.05) /* the fault file is polled at 20 Hz while a caller waits */
            nap = 0.05;
        if (next > now && next - now < nap)
            nap = next - now;
        struct timespec ts = {(time_t)nap, (long)((nap - (double)(time_t)nap) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* The first version's nvmlEventData_t ends after eventData (no MIG instance ids): 24 bytes. */
EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, void *data, unsigned int timeoutms)
{
    nvmlEventData_t full;
    nvmlReturn_t r;

    CHECK_PTR(data);
    r = nvmlEventSetWait_v2(set, &full, timeoutms);
    if (r == NVML_SUCCESS)
        memcpy(data, &full, offsetof(nvmlEventData_t, gpuInstanceId));
    return r;
}

/* ==== everything else the real driver answers =================================================
 *
 * Every one-argument nvmlDevice* and no-argument nvmlSystem* query of pynvml, as a real driver
 * (580.159.04, H100 80GB HBM3 and H200 passed through to a VM) answered it. Values come from the
 * profile (catalogue facts per SKU, host facts per profile); what a real datacenter GPU answers
 * with an error is answered with that same error. The rule for anything this library does not
 * model is the driver's own NVML_ERROR_NOT_SUPPORTED, never a missing symbol.
 */

#define NVML_ERROR_NOT_READY 27

/* A query the real driver answers with a fixed error on these GPUs (vGPU host features, Windows
 * driver models, fans, DRAM encryption, ...). Extra arguments are never read. */
#define DEVICE_ANSWERS(name, code)                                                                    \
    EXPORT nvmlReturn_t name(nvmlDevice_t device, void *a, void *b, void *c)                          \
    {                                                                                                 \
        (void)a;                                                                                      \
        (void)b;                                                                                      \
        (void)c;                                                                                      \
        CHECK_DEVICE(device);                                                                         \
        return code;                                                                                  \
    }

DEVICE_ANSWERS(nvmlDeviceGetActiveVgpus, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetAttributes_v2, NVML_ERROR_NOT_SUPPORTED) /* MIG-device attributes */
DEVICE_ANSWERS(nvmlDeviceGetAutoBoostedClocksEnabled, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetBridgeChipInfo, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetComputeInstanceId, NVML_ERROR_INVALID_ARGUMENT) /* not a MIG handle */
DEVICE_ANSWERS(nvmlDeviceGetGpuInstanceId, NVML_ERROR_INVALID_ARGUMENT)     /* not a MIG handle */
DEVICE_ANSWERS(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, NVML_ERROR_INVALID_ARGUMENT)
DEVICE_ANSWERS(nvmlDeviceGetCoolerInfo, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetCreatableVgpus, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetSupportedVgpus, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetDramEncryptionMode, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetDriverModel, NVML_ERROR_NOT_SUPPORTED)    /* Windows only */
DEVICE_ANSWERS(nvmlDeviceGetDriverModel_v2, NVML_ERROR_NOT_SUPPORTED) /* Windows only */
DEVICE_ANSWERS(nvmlDeviceGetFanSpeed, NVML_ERROR_NOT_SUPPORTED)       /* passively cooled */
DEVICE_ANSWERS(nvmlDeviceGetFanSpeed_v2, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetFanSpeedRPM, NVML_ERROR_INVALID_ARGUMENT) /* fan 0 of 0 fans */
DEVICE_ANSWERS(nvmlDeviceGetGpuOperationMode, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetHostVgpuMode, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetHostname_v1, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetLastBBXFlushTime, NVML_ERROR_NOT_READY)
DEVICE_ANSWERS(nvmlDeviceGetPgpuMetadataString, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetVgpuHeterogeneousMode, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetVgpuMetadata, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetVgpuSchedulerCapabilities, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetVgpuSchedulerLog, NVML_ERROR_NOT_SUPPORTED)
DEVICE_ANSWERS(nvmlDeviceGetVgpuSchedulerState, NVML_ERROR_NOT_SUPPORTED)

/* A fixed unsigned value. */
#define DEVICE_UINT(name, expr)                                                                       \
    EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *out)                                  \
    {                                                                                                 \
        CHECK_DEVICE(device);                                                                         \
        CHECK_PTR(out);                                                                               \
        *out = (expr);                                                                                \
        return NVML_SUCCESS;                                                                          \
    }

static int busy(nvmlDevice_t device)
{
    return live_bytes(dev_index(device)) > 0;
}

DEVICE_UINT(nvmlDeviceGetAccountingBufferSize, 4000u)
DEVICE_UINT(nvmlDeviceGetAccountingMode, 0u)
DEVICE_UINT(nvmlDeviceGetAdaptiveClockInfoStatus, 1u)
DEVICE_UINT(nvmlDeviceGetAddressingMode, 0u)
/* nvidia-smi prints it as "Board ID 0x6" for the GPU at 00:06.0: derived from the PCI location */
DEVICE_UINT(nvmlDeviceGetBoardId, (device->domain << 16) | (device->bus << 8) | device->device)
DEVICE_UINT(nvmlDeviceGetBrand, device->brand)
DEVICE_UINT(nvmlDeviceGetBusType, 2u) /* NVML_BUS_TYPE_PCIE */
DEVICE_UINT(nvmlDeviceGetComputeMode, 0u) /* NVML_COMPUTEMODE_DEFAULT */
DEVICE_UINT(nvmlDeviceGetDisplayActive, 0u)
DEVICE_UINT(nvmlDeviceGetDisplayMode, 1u)
DEVICE_UINT(nvmlDeviceGetGpcClkVfOffset, 0u)
DEVICE_UINT(nvmlDeviceGetMemClkVfOffset, 0u)
DEVICE_UINT(nvmlDeviceGetInforomConfigurationChecksum, 0u)
DEVICE_UINT(nvmlDeviceGetIrqNum, device->irq)
DEVICE_UINT(nvmlDeviceGetMaxMigDeviceCount, device->has_mig && device->mig_current ? 7u : 0u)
DEVICE_UINT(nvmlDeviceGetMemoryBusWidth, device->bus_width)
DEVICE_UINT(nvmlDeviceGetMultiGpuBoard, 0u)
DEVICE_UINT(nvmlDeviceGetNumFans, 0u)
DEVICE_UINT(nvmlDeviceGetNumGpuCores, device->cores)
DEVICE_UINT(nvmlDeviceGetPcieReplayCounter, 0u)
DEVICE_UINT(nvmlDeviceGetPowerManagementMode, 1u) /* NVML_FEATURE_ENABLED */
DEVICE_UINT(nvmlDeviceGetPowerSource, 0u)         /* NVML_POWER_SOURCE_AC */
DEVICE_UINT(nvmlDeviceGetPerformanceState, 0u)    /* P0, idle or not (as recorded) */
DEVICE_UINT(nvmlDeviceGetPowerState, 0u)
/* NVML_PCIE_LINK_MAX_SPEED_*: 1 = 2.5 GT/s ... 5 = 32 GT/s (Gen5), 6 = 64 GT/s (Gen6) */
DEVICE_UINT(nvmlDeviceGetPcieLinkMaxSpeed, device->pcie_max_gen)

/* Mb/s per lane as nvmlDeviceGetPcieSpeed reports it: 2500, 5000, 8000, 16000, 32000, 64000. */
EXPORT nvmlReturn_t nvmlDeviceGetPcieSpeed(nvmlDevice_t device, unsigned int *speed)
{
    static const unsigned int by_gen[] = {0, 2500, 5000, 8000, 16000, 32000, 64000};
    CHECK_DEVICE(device);
    CHECK_PTR(speed);
    *speed = device->pcie_cur_gen < 7 ? by_gen[device->pcie_cur_gen] : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, unsigned int *mode)
{
    CHECK_DEVICE(device);
    CHECK_PTR(mode);
    *mode = device->virt_mode; /* 0 bare metal, 1 passthrough */
    return NVML_SUCCESS;
}

static nvmlReturn_t device_string(nvmlDevice_t device, char *out, unsigned int length, const char *value)
{
    CHECK_DEVICE(device);
    if (value[0] == '\0')
        return NVML_ERROR_NOT_SUPPORTED; /* a board fact nobody recorded for this SKU */
    return copy_string(out, length, value);
}

EXPORT nvmlReturn_t nvmlDeviceGetBoardPartNumber(nvmlDevice_t device, char *partNumber, unsigned int length)
{
    return device_string(device, partNumber, length, valid_device(device) ? device->board_part : "");
}

EXPORT nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    return device_string(device, version, length, valid_device(device) ? device->vbios : "");
}

EXPORT nvmlReturn_t nvmlDeviceGetInforomImageVersion(nvmlDevice_t device, char *version, unsigned int length)
{
    if (valid_device(device) && !device->has_serial)
        return NVML_ERROR_NOT_SUPPORTED; /* boards without an inforom */
    return device_string(device, version, length, valid_device(device) ? device->inforom : "");
}

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1)
{
    CHECK_DEVICE(device);
    CHECK_PTR(bar1);
    if (device->bar1_total == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    bar1->bar1Total = device->bar1_total;
    bar1->bar1Used = device->bar1_used;
    bar1->bar1Free = device->bar1_total - device->bar1_used;
    return NVML_SUCCESS;
}

/* ---- clocks ---------------------------------------------------------------------------- */

enum { CLOCK_GRAPHICS = 0, CLOCK_SM = 1, CLOCK_MEM = 2, CLOCK_VIDEO = 3 };

/* Idle at the floor (as recorded: 345 MHz, clock-event reason "GPU idle"); busy at the max. */
EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    CHECK_DEVICE(device);
    CHECK_PTR(clock);
    int up = busy(device);
    switch (type) {
    case CLOCK_GRAPHICS:
    case CLOCK_SM: *clock = up ? device->clk_graphics_max : device->clk_graphics_idle; break;
    case CLOCK_MEM: *clock = device->clk_mem_max; break;
    case CLOCK_VIDEO: *clock = up ? device->clk_video_max : device->clk_video_idle; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return *clock ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *clock)
{
    CHECK_DEVICE(device);
    CHECK_PTR(clock);
    switch (type) {
    case CLOCK_GRAPHICS:
    case CLOCK_SM: *clock = device->clk_graphics_max; break;
    case CLOCK_MEM: *clock = device->clk_mem_max; break;
    case CLOCK_VIDEO: *clock = device->clk_video_max; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return *clock ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxCustomerBoostClock(nvmlDevice_t device, int type, unsigned int *clock)
{
    return nvmlDeviceGetMaxClockInfo(device, type, clock);
}

EXPORT nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t device, int type, unsigned int *clock)
{
    return nvmlDeviceGetMaxClockInfo(device, type, clock);
}

EXPORT nvmlReturn_t nvmlDeviceGetDefaultApplicationsClock(nvmlDevice_t device, int type, unsigned int *clock)
{
    return nvmlDeviceGetMaxClockInfo(device, type, clock);
}

/* nvmlClocksEventReasons: 0x1 = GPU idle; supported mask 0x1FF as a Hopper board reports it. */
static nvmlReturn_t event_reasons(nvmlDevice_t device, unsigned long long *reasons, int supported)
{
    CHECK_DEVICE(device);
    CHECK_PTR(reasons);
    *reasons = supported ? 0x1FFull : (busy(device) ? 0ull : 1ull);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return event_reasons(device, reasons, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return event_reasons(device, reasons, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return event_reasons(device, reasons, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return event_reasons(device, reasons, 1);
}


/* Two-phase: too small a buffer -> the count and INSUFFICIENT_SIZE. Highest clock first. */
EXPORT nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count,
                                                       unsigned int *clocks)
{
    CHECK_DEVICE(device);
    CHECK_PTR(count);
    if (device->n_mem_clocks == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (clocks == NULL || *count < device->n_mem_clocks) {
        *count = device->n_mem_clocks;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(clocks, device->mem_clocks, device->n_mem_clocks * sizeof *clocks);
    *count = device->n_mem_clocks;
    return NVML_SUCCESS;
}

/* P0 and P2 (as recorded: [2, 0]); the rest NVML_PSTATE_UNKNOWN (32). */
EXPORT nvmlReturn_t nvmlDeviceGetSupportedPerformanceStates(nvmlDevice_t device, unsigned int *pstates,
                                                            unsigned int size)
{
    CHECK_DEVICE(device);
    CHECK_PTR(pstates);
    if (size < 2 * sizeof *pstates)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    for (unsigned int i = 0; i < size / sizeof *pstates; i++)
        pstates[i] = 32;
    pstates[0] = 2;
    pstates[1] = 0;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version;
    char str[2048];
} nvmlClockString_v1_t;
_Static_assert(sizeof(nvmlClockString_v1_t) == 2052, "nvmlDeviceCurrentClockFreqs_v1_t layout");
#define NVML_CLOCK_STRING_V1 NVML_STRUCT_VERSION(nvmlClockString_v1_t, 1)

static int clock_entry(char *out, size_t room, const struct fake_device *d, unsigned int nvclock,
                       unsigned int memclock)
{
    return snprintf(out, room,
                    "nvclock=%u, nvclockmin=%u, nvclockmax=%u, nvclockeditable=0, memclock=%u, memclockmin=%u, "
                    "memclockmax=%u, memclockeditable=0, memTransferRate=%u, memTransferRatemin=%u, "
                    "memTransferRatemax=%u, memTransferRateeditable=0",
                    nvclock, d->clk_graphics_idle, d->clk_graphics_max, memclock, memclock, memclock,
                    2 * memclock, 2 * memclock, 2 * memclock);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClockFreqs(nvmlDevice_t device, nvmlClockString_v1_t *freqs)
{
    CHECK_DEVICE(device);
    CHECK_PTR(freqs);
    if (freqs->version != NVML_CLOCK_STRING_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (device->clk_graphics_max == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    clock_entry(freqs->str, sizeof freqs->str, device,
                busy(device) ? device->clk_graphics_max : device->clk_graphics_idle, device->clk_mem_max);
    return NVML_SUCCESS;
}

/* One entry per supported memory clock, lowest first: "perf=0, ... ; perf=1, ...". */
EXPORT nvmlReturn_t nvmlDeviceGetPerformanceModes(nvmlDevice_t device, nvmlClockString_v1_t *modes)
{
    CHECK_DEVICE(device);
    CHECK_PTR(modes);
    if (modes->version != NVML_CLOCK_STRING_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (device->clk_graphics_max == 0 || device->n_mem_clocks == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    size_t used = 0, room = sizeof modes->str;
    modes->str[0] = '\0';
    for (unsigned int i = 0; i < device->n_mem_clocks && used < room; i++) {
        unsigned int mem = device->mem_clocks[device->n_mem_clocks - 1 - i];
        int n = snprintf(modes->str + used, room - used, "%sperf=%u, ", i ? " ; " : "", i);
        if (n < 0 || (size_t)n >= room - used)
            break;
        used += (size_t)n;
        n = clock_entry(modes->str + used, room - used, device, device->clk_graphics_idle, mem);
        if (n < 0)
            break;
        used += (size_t)n;
    }
    return NVML_SUCCESS;
}

/* ---- power, utilization, engines --------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                                 unsigned int *maxLimit)
{
    CHECK_DEVICE(device);
    CHECK_PTR(minLimit);
    CHECK_PTR(maxLimit);
    *minLimit = device->power_min;
    *maxLimit = device->power_limit;
    return NVML_SUCCESS;
}

/* mJ since the driver loaded (taken as boot): the simulated draw integrated over time. */
EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    struct timespec now;
    CHECK_DEVICE(device);
    CHECK_PTR(energy);
    if (clock_gettime(CLOCK_BOOTTIME, &now) != 0)
        return NVML_ERROR_UNKNOWN;
    /* mW x ms / 1000 = mJ */
    *energy = (unsigned long long)device->power_usage *
              ((unsigned long long)now.tv_sec * 1000ull + (unsigned long long)now.tv_nsec / 1000000ull) / 1000ull;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    CHECK_DEVICE(device);
    CHECK_PTR(util);
    util->gpu = 0; /* the lab runs no kernels */
    util->memory = 0;
    return NVML_SUCCESS;
}

/* Video engines: 0 % over a 100 ms sample, as an idle GPU reports. */
static nvmlReturn_t engine_utilization(nvmlDevice_t device, unsigned int *util, unsigned int *period)
{
    CHECK_DEVICE(device);
    CHECK_PTR(util);
    CHECK_PTR(period);
    *util = 0;
    *period = 100000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p)
{
    return engine_utilization(d, u, p);
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p)
{
    return engine_utilization(d, u, p);
}

EXPORT nvmlReturn_t nvmlDeviceGetJpgUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p)
{
    return engine_utilization(d, u, p);
}

EXPORT nvmlReturn_t nvmlDeviceGetOfaUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p)
{
    return engine_utilization(d, u, p);
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderStats(nvmlDevice_t device, unsigned int *sessions, unsigned int *fps,
                                              unsigned int *latency)
{
    CHECK_DEVICE(device);
    CHECK_PTR(sessions);
    CHECK_PTR(fps);
    CHECK_PTR(latency);
    *sessions = *fps = *latency = 0;
    return NVML_SUCCESS;
}

/* No sessions: count 0 and SUCCESS. */
static nvmlReturn_t no_sessions(nvmlDevice_t device, unsigned int *count)
{
    CHECK_DEVICE(device);
    CHECK_PTR(count);
    *count = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderSessions(nvmlDevice_t device, unsigned int *count, void *infos)
{
    (void)infos;
    return no_sessions(device, count);
}

EXPORT nvmlReturn_t nvmlDeviceGetFBCSessions(nvmlDevice_t device, unsigned int *count, void *infos)
{
    (void)infos;
    return no_sessions(device, count);
}

EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t device, unsigned int *count, unsigned int *pids)
{
    (void)pids;
    return no_sessions(device, count); /* accounting is off */
}

typedef struct {
    unsigned int sessionsCount, averageFPS, averageLatency;
} nvmlFBCStats_t;

EXPORT nvmlReturn_t nvmlDeviceGetFBCStats(nvmlDevice_t device, nvmlFBCStats_t *stats)
{
    CHECK_DEVICE(device);
    CHECK_PTR(stats);
    memset(stats, 0, sizeof *stats);
    return NVML_SUCCESS;
}

/* nvmlGridLicensableFeatures_v4_t is 860 bytes; not licensable: all zero. */
EXPORT nvmlReturn_t nvmlDeviceGetGridLicensableFeatures_v4(nvmlDevice_t device, void *features)
{
    CHECK_DEVICE(device);
    CHECK_PTR(features);
    memset(features, 0, 860);
    return NVML_SUCCESS;
}

/* ---- processes: graphics and MPS (none; compute processes are the live state) --------------- */

static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *infoCount)
{
    return no_sessions(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v2_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_v1_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                               nvmlProcessInfo_v2_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                               nvmlProcessInfo_v2_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v1_t *infos)
{
    (void)infos;
    return no_processes(device, infoCount);
}

/* ---- ECC defaults, row remapper, repair -------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetDefaultEccMode(nvmlDevice_t device, int *defaultMode)
{
    CHECK_DEVICE(device);
    CHECK_PTR(defaultMode);
    if (!device->has_ecc)
        return NVML_ERROR_NOT_SUPPORTED;
    *defaultMode = 1;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int max, high, partial, low, none;
} nvmlRowRemapperHistogramValues_t;

/* Banks with all spare rows left (recorded: 2560 on H100 80GB, 3072 on H200): a healthy board. */
EXPORT nvmlReturn_t nvmlDeviceGetRowRemapperHistogram(nvmlDevice_t device, nvmlRowRemapperHistogramValues_t *v)
{
    CHECK_DEVICE(device);
    CHECK_PTR(v);
    if (!device->has_remap)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(v, 0, sizeof *v);
    v->max = device->row_remap_banks;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version, bChannelRepairPending, bTpcRepairPending;
} nvmlRepairStatus_t;

/* pynvml passes version 0 here and a real driver answers anyway: no version check. */
EXPORT nvmlReturn_t nvmlDeviceGetRepairStatus(nvmlDevice_t device, nvmlRepairStatus_t *status)
{
    CHECK_DEVICE(device);
    CHECK_PTR(status);
    status->bChannelRepairPending = status->bTpcRepairPending = 0;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version, unrepairableMemory;
} nvmlUnrepairableMemory_v1_t;

EXPORT nvmlReturn_t nvmlDeviceGetUnrepairableMemoryFlag_v1(nvmlDevice_t device, nvmlUnrepairableMemory_v1_t *flag)
{
    CHECK_DEVICE(device);
    CHECK_PTR(flag);
    flag->unrepairableMemory = device->remap[3];
    return NVML_SUCCESS;
}

/* ---- identity extras ------------------------------------------------------------------------ */

typedef struct {
    unsigned int version;
    unsigned long long value;
} nvmlPdi_t;

/* A per-GPU identifier: derived from the UUID (stable per profile and slot). */
EXPORT nvmlReturn_t nvmlDeviceGetPdi(nvmlDevice_t device, nvmlPdi_t *pdi)
{
    unsigned long long h = 1469598103934665603ull;
    CHECK_DEVICE(device);
    CHECK_PTR(pdi);
    for (const char *p = device->uuid; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    pdi->value = h;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version;
    int marginTemperature;
} nvmlMarginTemperature_v1_t;
#define NVML_MARGIN_TEMPERATURE_V1 NVML_STRUCT_VERSION(nvmlMarginTemperature_v1_t, 1)

/* Distance to the slowdown temperature (87 C on H100/H200: 34 C + 53 recorded). */
EXPORT nvmlReturn_t nvmlDeviceGetMarginTemperature(nvmlDevice_t device, nvmlMarginTemperature_v1_t *margin)
{
    CHECK_DEVICE(device);
    CHECK_PTR(margin);
    if (margin->version != NVML_MARGIN_TEMPERATURE_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    margin->marginTemperature = 87 - device->temperature;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int isC2cEnabled;
} nvmlC2cModeInfo_v1_t;

EXPORT nvmlReturn_t nvmlDeviceGetC2cModeInfoV(nvmlDevice_t device, nvmlC2cModeInfo_v1_t *info)
{
    CHECK_DEVICE(device);
    CHECK_PTR(info);
    info->isC2cEnabled = 0; /* no Grace C2C link on these boards */
    return NVML_SUCCESS;
}

/* ---- NUMA and CPU affinity ------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                unsigned long *nodeSet, int scope)
{
    CHECK_DEVICE(device);
    if (nodeSetSize == 0 || nodeSet == NULL || scope < 0 || scope > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < nodeSetSize; i++)
        nodeSet[i] = 0;
    if (device->numa_node / 64 < nodeSetSize)
        nodeSet[device->numa_node / 64] = 1ul << (device->numa_node % 64);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                        unsigned long *cpuSet, int scope)
{
    if (scope < 0 || scope > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    return nvmlDeviceGetCpuAffinity(device, cpuSetSize, cpuSet);
}

/* ---- confidential computing (Hopper and newer; off) ---------------------------------------- */

typedef struct {
    unsigned long long protectedMemSizeKib, unprotectedMemSizeKib;
} nvmlConfComputeMemSizeInfo_t;

EXPORT nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device, nvmlConfComputeMemSizeInfo_t *info)
{
    CHECK_DEVICE(device);
    CHECK_PTR(info);
    if (!device->conf_compute)
        return NVML_ERROR_NOT_SUPPORTED;
    info->protectedMemSizeKib = 0;
    info->unprotectedMemSizeKib = (device->mem_total - device->mem_reserved) / 1024; /* = CUDA's total */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetConfComputeProtectedMemoryUsage(nvmlDevice_t device, nvmlMemory_t *memory)
{
    CHECK_DEVICE(device);
    CHECK_PTR(memory);
    if (!device->conf_compute)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(memory, 0, sizeof *memory);
    return NVML_SUCCESS;
}

/* With CC off a real H100/H200 answers NVML_ERROR_UNKNOWN. */
EXPORT nvmlReturn_t nvmlDeviceGetConfComputeGpuCertificate(nvmlDevice_t device, void *cert)
{
    (void)cert;
    CHECK_DEVICE(device);
    return device->conf_compute ? NVML_ERROR_UNKNOWN : NVML_ERROR_NOT_SUPPORTED;
}

typedef struct {
    unsigned int cpuCaps, gpusCaps;
} nvmlConfComputeSystemCaps_t;

EXPORT nvmlReturn_t nvmlSystemGetConfComputeCapabilities(nvmlConfComputeSystemCaps_t *caps)
{
    CHECK_INIT();
    CHECK_PTR(caps);
    caps->cpuCaps = 0; /* NVML_CC_SYSTEM_CPU_CAPS_NONE */
    caps->gpusCaps = 0;
    for (unsigned int i = 0; i < g_count; i++)
        if (g_devs[i].conf_compute)
            caps->gpusCaps = 1; /* NVML_CC_SYSTEM_GPUS_CC_CAPABLE */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetConfComputeGpusReadyState(unsigned int *isAcceptingWork)
{
    CHECK_INIT();
    CHECK_PTR(isAcceptingWork);
    *isAcceptingWork = 0;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int environment, ccFeature, devToolsMode;
} nvmlConfComputeSystemState_t;

EXPORT nvmlReturn_t nvmlSystemGetConfComputeState(nvmlConfComputeSystemState_t *state)
{
    CHECK_INIT();
    CHECK_PTR(state);
    memset(state, 0, sizeof *state);
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int version;
    unsigned long long attackerAdvantage;
} nvmlConfComputeGetKeyRotationThresholdInfo_t;
#define NVML_KEY_ROTATION_V1 NVML_STRUCT_VERSION(nvmlConfComputeGetKeyRotationThresholdInfo_t, 1)

EXPORT nvmlReturn_t nvmlSystemGetConfComputeKeyRotationThresholdInfo(nvmlConfComputeGetKeyRotationThresholdInfo_t *info)
{
    CHECK_INIT();
    CHECK_PTR(info);
    if (info->version != NVML_KEY_ROTATION_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    info->attackerAdvantage = 60; /* the driver default, as recorded */
    return NVML_SUCCESS;
}

/* ---- system extras -------------------------------------------------------------------------- */

typedef struct {
    unsigned int version;
    char branch[80];
} nvmlSystemDriverBranchInfo_v1_t;
_Static_assert(sizeof(nvmlSystemDriverBranchInfo_v1_t) == 84, "nvmlSystemDriverBranchInfo_v1_t layout");
#define NVML_DRIVER_BRANCH_V1 NVML_STRUCT_VERSION(nvmlSystemDriverBranchInfo_v1_t, 1)

EXPORT nvmlReturn_t nvmlSystemGetDriverBranch(nvmlSystemDriverBranchInfo_v1_t *info, unsigned int length)
{
    CHECK_INIT();
    CHECK_PTR(info);
    if (info->version != NVML_DRIVER_BRANCH_V1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return copy_string(info->branch, length < sizeof info->branch ? length : sizeof info->branch,
                       g_driver_branch);
}

/* No HIC (the bridge chip of old multi-GPU boards). */
EXPORT nvmlReturn_t nvmlSystemGetHicVersion(unsigned int *hwbcCount, void *entries)
{
    (void)entries;
    CHECK_INIT();
    CHECK_PTR(hwbcCount);
    *hwbcCount = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetNvlinkBwMode(unsigned int *mode)
{
    CHECK_INIT();
    CHECK_PTR(mode);
    *mode = 0; /* NVML_NVLINK_POWER_STATE_... full bandwidth */
    return NVML_SUCCESS;
}
