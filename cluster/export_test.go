package cluster

import "reflect"

// BoltNoSync reads the NoSync flag of the node's open bbolt handle. The
// store does not expose it, so the test looks through reflection at the
// real handle rather than trusting the options we passed.
func BoltNoSync(n *Node) bool {
	conn := reflect.ValueOf(n.store).Elem().FieldByName("conn")
	return conn.Elem().FieldByName("NoSync").Bool()
}

// BoltOptionsNoSync is the NoSync value New passes to raft-boltdb.
func BoltOptionsNoSync() bool { return boltOptions("x").NoSync }
