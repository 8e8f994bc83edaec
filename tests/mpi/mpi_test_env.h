#pragma once
// The process's MPI session, for tests that run under mpirun (see mpi_test_main.cpp).
#include <stdexcept>

#include "runtime/comm/mpi_communicator.h"

namespace pf::testing {

inline const comm::MpiSession*& mpi_session_slot() {
  static const comm::MpiSession* session = nullptr;
  return session;
}
inline void set_mpi_session(const comm::MpiSession& session) {
  mpi_session_slot() = &session;
}
inline const comm::MpiSession& mpi_session() {
  if (mpi_session_slot() == nullptr)
    throw std::logic_error("no MPI session: run via mpi_test_main");
  return *mpi_session_slot();
}

}  // namespace pf::testing
