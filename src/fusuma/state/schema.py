"""The state file's tables, and the columns added to them since their first version."""

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS partitions (
    name TEXT PRIMARY KEY,
    cpus TEXT NOT NULL,
    memory_mib INTEGER NOT NULL,
    io_weight INTEGER,
    qemu TEXT,
    supervisor_pid INTEGER,
    created_at REAL NOT NULL,
    memory_overcommit REAL           -- NULL: the host's (fusuma.capacity)
);
CREATE TABLE IF NOT EXISTS disks (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    partition TEXT NOT NULL REFERENCES partitions(name),
    created_file INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS storage (
    path TEXT PRIMARY KEY,           -- a directory root declared for disk files
    created_at REAL NOT NULL,
    shared INTEGER NOT NULL DEFAULT 0 -- the same files on other hosts (`--shared`)
);
CREATE TABLE IF NOT EXISTS vms (
    name TEXT PRIMARY KEY,
    partition TEXT NOT NULL REFERENCES partitions(name),
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    image TEXT NOT NULL,
    disks TEXT NOT NULL,
    accel TEXT NOT NULL,
    autostart INTEGER NOT NULL,
    state TEXT NOT NULL,
    pid INTEGER,
    accel_used TEXT,
    qemu_binary TEXT,
    started_at REAL,
    error TEXT,
    created_at REAL NOT NULL,
    shared_ram INTEGER NOT NULL DEFAULT 1,
    ram_path TEXT,
    qos TEXT NOT NULL DEFAULT 'burstable',
    segments TEXT NOT NULL DEFAULT '[]',
    mergeable INTEGER NOT NULL DEFAULT 0,
    ports TEXT NOT NULL DEFAULT '[]',
    overhead_mib INTEGER,
    page_reporting INTEGER,
    template TEXT,
    memory_class TEXT NOT NULL DEFAULT 'guaranteed',
    memory_min INTEGER               -- a burstable VM's floor, MiB
);
CREATE TABLE IF NOT EXISTS jobs (
    obj TEXT PRIMARY KEY,            -- "vm:NAME" or "partition:NAME"
    kind TEXT NOT NULL,
    phase TEXT NOT NULL,
    source TEXT,
    peer TEXT,
    owner_pid INTEGER NOT NULL,
    owner_start INTEGER NOT NULL,    -- the owner's start time (clock ticks): pid reuse
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    type TEXT NOT NULL,              -- lifecycle | operation | governor
    action TEXT NOT NULL,            -- vm-started, vm-moved, partition-resized, ...
    source TEXT NOT NULL,            -- the API path of the object: /1.0/vms/NAME
    context TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS tokens (
    name TEXT PRIMARY KEY,
    hash TEXT NOT NULL UNIQUE,       -- sha256 of the token; the token itself is never kept
    created_at REAL NOT NULL,
    last_used_at REAL,
    role TEXT                        -- fusuma.state.roles.Role; NULL: made before roles
);
CREATE TABLE IF NOT EXISTS segments (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    size_bytes INTEGER NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    ram_path TEXT NOT NULL UNIQUE,   -- the guest RAM file (shm dir), read-only for clones
    state_path TEXT NOT NULL UNIQUE, -- device state (migration stream without shared RAM)
    size_bytes INTEGER NOT NULL,     -- of the RAM file
    memory_mib INTEGER NOT NULL,
    vcpus INTEGER NOT NULL,
    machine TEXT NOT NULL,
    qemu_version TEXT NOT NULL,
    devices TEXT NOT NULL,           -- the guest's DeviceSet as JSON
    image TEXT NOT NULL,
    segments TEXT NOT NULL DEFAULT '[]',
    accel TEXT NOT NULL,
    state_sha256 TEXT NOT NULL,
    source_vm TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS networks (
    name TEXT PRIMARY KEY,
    type TEXT NOT NULL,              -- managed | bridged
    bridge TEXT NOT NULL UNIQUE,     -- the Linux bridge (made by fusuma when managed)
    subnet TEXT,                     -- managed: "10.0.5.0/24"; the gateway is its .1
    nat INTEGER NOT NULL DEFAULT 0,
    isolated INTEGER NOT NULL DEFAULT 0,
    filtering INTEGER NOT NULL DEFAULT 0,
    keeper_pid INTEGER,              -- the supervisor of its dnsmasq
    created_at REAL NOT NULL,
    mtu INTEGER NOT NULL DEFAULT 1500  -- the bridge's, its taps' and its guests'
);
CREATE TABLE IF NOT EXISTS nics (
    vm TEXT NOT NULL REFERENCES vms(name) ON DELETE CASCADE,
    idx INTEGER NOT NULL,            -- its place among the VM's NICs (net0, net1, ...)
    network TEXT NOT NULL REFERENCES networks(name),
    mac TEXT NOT NULL UNIQUE,
    ip TEXT,                         -- managed networks: the address dnsmasq gives it
    PRIMARY KEY (vm, idx)
);
CREATE UNIQUE INDEX IF NOT EXISTS nics_ip ON nics(network, ip);
CREATE TABLE IF NOT EXISTS images (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,       -- the read-only copy in the image store
    format TEXT NOT NULL,            -- qcow2 | raw
    virtual_size INTEGER NOT NULL,   -- bytes the guest sees
    file_size INTEGER NOT NULL,      -- bytes of the stored file
    sha256 TEXT NOT NULL,            -- of the stored file, checked when imported
    source TEXT NOT NULL,            -- the file it was imported from
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    vm TEXT NOT NULL REFERENCES vms(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    memory INTEGER NOT NULL,         -- the RAM and device state too
    disks TEXT NOT NULL,             -- JSON: the drives whose qcow2 holds it
    state TEXT NOT NULL,             -- creating | ready | deleting (fusuma.state.snapdb)
    created_at REAL NOT NULL,
    running INTEGER NOT NULL,        -- the VM ran when it was taken
    frozen INTEGER NOT NULL,         -- the guest agent froze its filesystems
    devices TEXT,                    -- a memory snapshot: the guest's device set
    vmstate_bytes INTEGER,
    PRIMARY KEY (vm, name)
);
"""

# Columns added after a table's first version: (table, column, definition). A state
# file from an older fusuma gets them on open.
ADDED_COLUMNS = (
    ("vms", "shared_ram", "INTEGER NOT NULL DEFAULT 1"),
    ("vms", "ram_path", "TEXT"),
    ("vms", "qos", "TEXT NOT NULL DEFAULT 'burstable'"),
    ("vms", "segments", "TEXT NOT NULL DEFAULT '[]'"),
    ("vms", "mergeable", "INTEGER NOT NULL DEFAULT 0"),
    ("vms", "ports", "TEXT NOT NULL DEFAULT '[]'"),
    ("vms", "overhead_mib", "INTEGER"),
    ("partitions", "smt", "TEXT NOT NULL DEFAULT 'cores'"),
    ("vms", "emulator", "TEXT NOT NULL DEFAULT 'shared'"),
    ("vms", "machine", "TEXT"),
    ("vms", "devices", "TEXT"),
    ("vms", "qemu_version", "TEXT"),
    ("vms", "page_reporting", "INTEGER"),
    ("vms", "template", "TEXT"),
    ("tokens", "role", "TEXT"),
    ("disks", "dev", "INTEGER"),
    ("disks", "ino", "INTEGER"),
    ("vms", "uid", "INTEGER"),
    ("templates", "gid", "INTEGER"),
    ("templates", "networks", "TEXT NOT NULL DEFAULT '[]'"),
    ("vms", "boot", "TEXT NOT NULL DEFAULT 'kernel'"),
    ("networks", "mtu", "INTEGER NOT NULL DEFAULT 1500"),
    ("partitions", "memory_overcommit", "REAL"),
    ("vms", "memory_class", "TEXT NOT NULL DEFAULT 'guaranteed'"),
    ("vms", "memory_min", "INTEGER"),
    ("storage", "shared", "INTEGER NOT NULL DEFAULT 0"),
)

# One id is one record's: a VM's uid is no other VM's, a template's gid no other
# template's (fusuma.state.db allocates both, in one transaction, from two ranges that
# do not meet; records from before those ranges keep the ids they had).
ID_INDEXES = """
CREATE UNIQUE INDEX IF NOT EXISTS vms_uid ON vms(uid);
CREATE UNIQUE INDEX IF NOT EXISTS templates_gid ON templates(gid);
"""
