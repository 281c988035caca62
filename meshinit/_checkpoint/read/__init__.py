"""The load flow: survey the files, plan the reads, fetch and place each block,
finish, reshard."""
