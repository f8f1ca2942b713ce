// MakeSerializationDeterministic: makes every protobuf serialization of the
// process deterministic — gRPC's of each response included — so equal
// messages are equal bytes whatever order their maps' entries are in. A
// retried sequenced request is answered from the cached response parsed and
// serialized again: with it, the retry gets the very bytes the first caller
// got (docs/reliability.md, "Retries replay").
//
//   int main(int argc, char** argv) {
//     tally::MakeSerializationDeterministic();  // before any thread starts
//     ...
//   }
#ifndef TALLY_SERVER_DETERMINISTIC_SERIALIZATION_H_
#define TALLY_SERVER_DETERMINISTIC_SERIALIZATION_H_

namespace tally {

// Process-wide and irreversible. Threads started after it see it; a thread
// already running may not (protobuf's own rule).
void MakeSerializationDeterministic();

}  // namespace tally

#endif  // TALLY_SERVER_DETERMINISTIC_SERIALIZATION_H_
