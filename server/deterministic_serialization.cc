#include "server/deterministic_serialization.h"

#include <google/protobuf/io/coded_stream.h>

// protobuf (3.21 and later) keeps the process-wide switch,
// CodedOutputStream::SetDefaultSerializationDeterministic, private and
// befriends this function for the purpose ("other projects may use friend to
// allow them to call this"); only protobuf's own tests define it, in no
// library, so the server does.
namespace google::protobuf::internal {

void MapTestForceDeterministic() {
  io::CodedOutputStream::SetDefaultSerializationDeterministic();
}

}  // namespace google::protobuf::internal

namespace tally {

void MakeSerializationDeterministic() {
  google::protobuf::internal::MapTestForceDeterministic();
}

}  // namespace tally
