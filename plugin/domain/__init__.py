"""Domain XML: rendering new domains from templates (``render``) and reading
or rewriting existing ones as a model, never by string surgery (``model``).

Every accelmig domain carries a metadata element in accelmig's own XML
namespace::

    <metadata>
      <accelmig:domain xmlns:accelmig="http://accelmig.dev/xmlns/domain/1">
        <accelmig:fabric mac="52:54:00:12:34:56"/>   <!-- the accelerator-fabric NIC -->
        <accelmig:interfaces owner="accelmig"/>      <!-- "external": Nova/Neutron own them -->
        <accelmig:tenant name="alice"/>              <!-- optional -->
      </accelmig:domain>
    </metadata>

and the guest agent's virtio-serial channel (no source path: libvirt makes a
per-domain socket on each host)::

    <channel type='unix'><source mode='bind'/><target type='virtio' name='org.accelmig.agent.0'/></channel>
"""

ACCELMIG_NS = "http://accelmig.dev/xmlns/domain/1"
ACCELMIG_NS_PREFIX = "accelmig"
AGENT_CHANNEL_NAME = "org.accelmig.agent.0"
QEMU_GA_CHANNEL_NAME = "org.qemu.guest_agent.0"
