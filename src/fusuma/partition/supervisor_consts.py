"""Names shared by the supervisor and the migration code."""

# Prefix of the sub-directory of a VM's run dir that holds a migration destination's
# sockets. Unique per migration: QEMU unlinks its socket paths on exit, so a source
# that was itself migrated in must not share paths with the new destination.
INCOMING_PREFIX = "in-"
