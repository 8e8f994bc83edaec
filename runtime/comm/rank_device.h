#pragma once
// Which GPU an MPI rank drives: its local rank (its index among the ranks on its node, from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED); OpenMPI also exports it as
// OMPI_COMM_WORLD_LOCAL_RANK), so that `mpirun -np 8` on a node with 8 GPUs gives GPU i to
// local rank i. More ranks than GPUs on a node is an error unless sharing is asked for (NCCL
// before its newest releases refuses two ranks on one GPU: "Duplicate GPU detected").
namespace pf::comm {

// Throws std::invalid_argument naming the rank, its local rank and the GPU count when there is
// no GPU, or more local ranks than GPUs without share_devices (then it is local_rank mod
// devices).
int device_for_local_rank(int rank, int local_rank, int devices, bool share_devices);

}  // namespace pf::comm
